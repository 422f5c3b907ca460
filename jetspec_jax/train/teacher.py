"""The target as teacher: its K most likely next tokens, computed once per position.

A head is trained towards the target's next-token distribution at each drafted position. Kept
whole, that is a [V] vector per slot, and its log-softmax over 49k-151k entries is much of a
training step's memory traffic; its top K is K log-probabilities and ids per position, small
enough to store beside the tokens at data generation (`data.make_dataset`), so training runs
no teacher LM head at all. The loss (`loss.slot_topk_kl`) compares head and teacher on those K
tokens and the rest's mass, so what K leaves out still counts as one outcome.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

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


def label_top_k(tparams, tcfg: ModelConfig, tokens: np.ndarray, lengths: np.ndarray,
                top_k: int, *, batch_tokens: int = 32768, bucket: int = 128,
                dtype=np.float32, timing: dict | None = None) -> dict[str, np.ndarray]:
    """The teacher-forced target over sequences tokens [S, T] of lengths [S] -> top_logp [S, T, K]
    (dtype) and top_ids [S, T, K] int32: position t's K most likely next tokens (zeros past
    each length). Batches hold about batch_tokens tokens (rows of one width, a multiple of
    bucket: one compiled program per width, compiled ahead; timing["compile_seconds"] adds up
    their compile time); the next batch runs while the last is copied out."""
    if not 1 <= top_k <= tcfg.vocab_size:
        raise ValueError(f"teacher top-K must be in [1, {tcfg.vocab_size}], got {top_k}")
    n, t = tokens.shape
    out = {"top_logp": np.zeros((n, t, top_k), dtype), "top_ids": np.zeros((n, t, top_k), np.int32)}
    timing = {} if timing is None else timing
    params = (jax.tree.structure(tparams), tuple((x.shape, x.dtype)
                                                 for x in jax.tree.leaves(tparams)))

    def run(tparams, batch):
        key = (tcfg, top_k, batch.shape, params)
        if key not in _PROGRAMS:
            start = time.perf_counter()
            _PROGRAMS[key] = _top_k_program(tcfg, top_k).lower(tparams, batch).compile()
            timing["compile_seconds"] = (timing.get("compile_seconds", 0.0)
                                         + time.perf_counter() - start)
        return _PROGRAMS[key](tparams, batch)

    def store(rows, result):
        logp, ids = jax.device_get(result)
        for i, r in enumerate(rows):
            m = int(lengths[r])
            out["top_logp"][r, :m], out["top_ids"][r, :m] = logp[i, :m], ids[i, :m]

    pending = None
    for rows, batch in width_batches(tokens, lengths, batch_tokens, bucket):
        result = run(tparams, jnp.asarray(batch))  # dispatched: runs while `pending` is read
        if pending is not None:
            store(*pending)
        pending = rows, result
    if pending is not None:
        store(*pending)
    return out


def width_batches(tokens: np.ndarray, lengths: np.ndarray, batch_tokens: int,
                  bucket: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(rows, batch [rows per width, width]) over tokens [S, T] grouped by their length
    rounded up to a multiple of bucket (at most T), batch_tokens // width rows a batch (at
    least one; the last of a width padded with zero rows), shortest first."""
    t = tokens.shape[1]
    widths = np.minimum(-(-np.maximum(lengths, 1) // bucket) * bucket, t)
    for width in np.unique(widths):
        size = max(1, batch_tokens // int(width))
        same = np.flatnonzero(widths == width)
        for start in range(0, len(same), size):
            rows = same[start:start + size]
            batch = np.zeros((size, width), np.int32)
            batch[:len(rows)] = tokens[rows, :width]
            yield rows, batch


_PROGRAMS: dict = {}  # compiled per (config, K, batch shape, parameters' shapes and dtypes)


def _top_k_program(tcfg: ModelConfig, top_k: int):
    def run(tparams, tokens):
        hidden, _ = target_pass(tparams, tcfg, tokens, ())
        return top_k_teacher(target.lm_head(tparams, tcfg, hidden), top_k)
    return jax.jit(run)
