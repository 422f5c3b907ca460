"""The target as teacher: its K most likely next tokens, computed once per position.

A head is trained towards the target's next-token distribution at each drafted position. Kept
whole, that is a [V] vector per slot, and its log-softmax over 49k-151k entries is much of a
training step's memory traffic; its top K is K log-probabilities and ids per position, small
enough to store beside the tokens at data generation (`data.make_dataset`), so training runs
no teacher LM head at all. The loss (`loss.slot_topk_kl`) compares head and teacher on those K
tokens and the rest's mass, so what K leaves out still counts as one outcome.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.model import target
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.layers import exact_top_k
from jetspec_jax.train.head_forward import target_pass


def top_k_teacher(logits, top_k: int):
    """logits [..., V] -> the K most likely tokens' log-probabilities (under the full softmax)
    and ids [..., K] int32, most likely first: top_k of the logits minus their logsumexp (the
    log-softmax's top-K without a second [..., V] array)."""
    logits = logits.astype(jnp.float32)
    top, ids = exact_top_k(logits, top_k)
    return top - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids


BATCH_TOKENS = 32768  # tokens a labelling batch holds
BUCKET = 128  # sequence widths are multiples of this: one compiled program per width


def label_top_k(tparams, tcfg: ModelConfig, tokens: np.ndarray, lengths: np.ndarray,
                top_k: int, *, batch_tokens: int = BATCH_TOKENS, bucket: int = BUCKET,
                dtype=np.float32, timing: dict | None = None) -> dict[str, np.ndarray]:
    """The teacher-forced target over sequences tokens [S, T] of lengths [S] -> top_logp [S, T, K]
    (dtype) and top_ids [S, T, K] int32: position t's K most likely next tokens (zeros past
    each length). Batches hold about batch_tokens tokens (rows of one width, a multiple of
    bucket: one compiled program per width, compiled before the first batch runs, unless
    `compile_ahead` has them ready; timing["compile_seconds"] adds up the time spent waiting
    for them); the next batch runs while the last is copied out."""
    if not 1 <= top_k <= tcfg.vocab_size:
        raise ValueError(f"teacher top-K must be in [1, {tcfg.vocab_size}], got {top_k}")
    n, t = tokens.shape
    out = {"top_logp": np.zeros((n, t, top_k), dtype), "top_ids": np.zeros((n, t, top_k), np.int32)}
    timing = {} if timing is None else timing
    shapes = batch_shapes(lengths, t, batch_tokens, bucket)
    start = time.perf_counter()
    signature = _signature(tparams)
    got = [_program(tparams, signature, tcfg, top_k, shape) for shape in shapes]
    programs = {shape: future.result() for shape, (future, _) in zip(shapes, got)}
    if not all(ready for _, ready in got):
        timing["compile_seconds"] = (timing.get("compile_seconds", 0.0)
                                     + time.perf_counter() - start)

    def store(rows, result):
        logp, ids = jax.device_get(result)
        for i, r in enumerate(rows):
            m = int(lengths[r])
            out["top_logp"][r, :m], out["top_ids"][r, :m] = logp[i, :m], ids[i, :m]

    pending = None
    for rows, batch in width_batches(tokens, lengths, batch_tokens, bucket):
        result = programs[batch.shape](tparams, jnp.asarray(batch))  # runs while `pending`
        #                                                               is copied out
        if pending is not None:
            store(*pending)
        pending = rows, result
    if pending is not None:
        store(*pending)
    return out


def compile_ahead(tparams, tcfg: ModelConfig, top_k: int, max_len: int, *,
                  batch_tokens: int = BATCH_TOKENS, bucket: int = BUCKET) -> None:
    """Starts compiling, one after another on a background thread, the programs of every width
    that `label_top_k` can meet in sequences of up to max_len tokens, so that they compile
    while the target is still generating the answers (compiled in front of the labelling, 8
    widths took four times the labelling itself on a GPU). label_top_k waits for those it
    needs."""
    widths = np.unique(_widths(np.arange(1, max_len + 1), max_len, bucket))
    signature = _signature(tparams)
    claims = [(shape, *_claim(signature, tcfg, top_k, shape))
              for shape in _shapes(widths, batch_tokens)]
    todo = [(shape, future) for shape, future, mine in claims if mine]
    if todo:
        threading.Thread(target=_compile_each, args=(tparams, tcfg, top_k, todo),
                         daemon=True).start()


def width_batches(tokens: np.ndarray, lengths: np.ndarray, batch_tokens: int,
                  bucket: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(rows, batch [rows per width, width]) over tokens [S, T] grouped by their length
    rounded up to a multiple of bucket (at most T), batch_tokens // width rows a batch (at
    least one; the last of a width padded with zero rows), shortest first."""
    widths = _widths(lengths, tokens.shape[1], bucket)
    for width in np.unique(widths):
        size = _rows_per_batch(int(width), batch_tokens)
        same = np.flatnonzero(widths == width)
        for start in range(0, len(same), size):
            rows = same[start:start + size]
            batch = np.zeros((size, width), np.int32)
            batch[:len(rows)] = tokens[rows, :width]
            yield rows, batch


def batch_shapes(lengths: np.ndarray, t: int, batch_tokens: int,
                 bucket: int) -> list[tuple[int, int]]:
    """The shapes of `width_batches`' batches, one per width, shortest first."""
    return _shapes(np.unique(_widths(lengths, t, bucket)), batch_tokens)


def _widths(lengths: np.ndarray, t: int, bucket: int) -> np.ndarray:
    return np.minimum(-(-np.maximum(lengths, 1) // bucket) * bucket, t)


def _shapes(widths, batch_tokens: int) -> list[tuple[int, int]]:
    return [(_rows_per_batch(int(w), batch_tokens), int(w)) for w in widths]


def _rows_per_batch(width: int, batch_tokens: int) -> int:
    return max(1, batch_tokens // width)


_PROGRAMS: dict = {}  # Future of the compiled program per (parameters, config, K, batch shape)
_LOCK = threading.Lock()


def _signature(tparams):
    """What of the parameters a compiled program depends on: their tree, shapes and dtypes
    (read once per call: a target has hundreds of leaves)."""
    return (jax.tree.structure(tparams),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(tparams)))


def _program(tparams, signature, tcfg: ModelConfig, top_k: int,
             shape: tuple[int, int]) -> tuple[Future, bool]:
    """One batch shape's program (a Future), compiled here and now unless it is compiled or
    being compiled already, and whether it was ready."""
    future, mine = _claim(signature, tcfg, top_k, shape)
    ready = future.done()
    if mine:
        _compile_each(tparams, tcfg, top_k, [(shape, future)])
    return future, ready


def _claim(signature, tcfg: ModelConfig, top_k: int,
           shape: tuple[int, int]) -> tuple[Future, bool]:
    """The Future of this program, and whether the caller is to compile it (none was there)."""
    key = (signature, tcfg, top_k, shape)
    with _LOCK:
        mine = key not in _PROGRAMS
        return _PROGRAMS.setdefault(key, Future()), mine


def _compile_each(tparams, tcfg: ModelConfig, top_k: int, todo) -> None:
    for shape, future in todo:
        try:
            future.set_result(_top_k_program(tcfg, top_k).lower(
                tparams, jax.ShapeDtypeStruct(shape, jnp.int32)).compile())
        except Exception as e:  # raised where the program is needed
            future.set_exception(e)


def _top_k_program(tcfg: ModelConfig, top_k: int):
    def run(tparams, tokens):
        hidden, _ = target_pass(tparams, tcfg, tokens, ())
        return top_k_teacher(target.lm_head(tparams, tcfg, hidden), top_k)
    return jax.jit(run)
