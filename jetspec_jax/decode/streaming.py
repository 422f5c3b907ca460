"""Streamed generation: the decoding loops of `autoregressive.py` and `speculative.py` run in chunks
of a few steps or rounds, and the host reads the new tokens after each chunk. The chunks
continue one state (donated, so the KV caches are updated in place), so the tokens are those
of one whole loop. `api.stream` is the entry point."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jetspec_jax.decode import autoregressive as decode, speculative
from jetspec_jax.decode.loop import Loop

# Default rounds (speculative) and steps (autoregressive) per chunk. On a CPU each call costs
# more than its steps: XLA:CPU maps a fresh temporary buffer per call and faults it in. Chunks
# of one round or step were much slower than the whole loop there, these a few percent
# (docs/benchmarks.md, streaming). A GPU's temporaries come from a pooled allocator.
SPEC_CHUNK, AR_CHUNK = 4, 8

_ar_start = jax.jit(decode.ar_start, static_argnames=("cfg", "sampler", "loop"))
_ar_continue = jax.jit(decode.ar_continue, static_argnames=("cfg", "sampler", "loop", "max_steps"),
                       donate_argnames="state")
_SPEC = ("tcfg", "dcfg", "tree_spec", "sampler", "loop")
_spec_start = jax.jit(speculative.spec_start, static_argnames=_SPEC)
_spec_continue = jax.jit(speculative.spec_continue, static_argnames=(*_SPEC, "max_rounds"),
                         donate_argnames="state")


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    tokens: list[list[int]]  # ids committed since the previous chunk, per sequence
    texts: list[str]  # their text; "" without a tokenizer. A character whose bytes span
    #                   tokens is held back until it is whole (or the sequence ends)
    done: list[bool]
    num_tokens: list[int]  # generated so far, per sequence
    rounds: list[int] | None  # speculative rounds so far, per sequence; None: autoregressive


@dataclasses.dataclass(frozen=True)
class Steps:
    """Two jitted functions and their static arguments: start(*params, prompt, prompt_lens,
    key) -> the state after the prefill; advance(*params, state) -> the state a chunk later
    (the old state donated)."""
    start: Callable
    start_static: dict
    advance: Callable
    advance_static: dict


def ar_steps(cfg, sampler, loop: Loop, chunk: int | None = None) -> Steps:
    """The autoregressive loop (`decode.ar_generate`'s arguments) in chunks of steps."""
    static = dict(cfg=cfg, sampler=sampler, loop=loop)
    return Steps(_ar_start, static, _ar_continue,
                 dict(static, max_steps=_chunk(chunk, AR_CHUNK)))


def spec_steps(tcfg, dcfg, tree_spec, sampler, loop: Loop, chunk: int | None = None) -> Steps:
    """The speculative loop (`speculative.spec_generate`'s arguments) in chunks of rounds."""
    static = dict(tcfg=tcfg, dcfg=dcfg, tree_spec=tree_spec, sampler=sampler, loop=loop)
    return Steps(_spec_start, static, _spec_continue,
                 dict(static, max_rounds=_chunk(chunk, SPEC_CHUNK)))


def _chunk(chunk: int | None, default: int) -> int:
    if chunk is None:
        return default
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be a whole number of steps >= 1, got {chunk!r}")
    return int(chunk)


class TextDeltas:
    """The new text of each sequence, from all its tokens so far: decoding them whole keeps
    the tokenizer's spacing rules, and a trailing U+FFFD (a character cut between tokens) is
    held back until the next tokens complete it."""

    def __init__(self, tokenizer, batch: int):
        self.tokenizer, self.sent = tokenizer, [0] * batch

    def __call__(self, b: int, ids: list[int], final: bool) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        new = text[self.sent[b]:]
        self.sent[b] = max(self.sent[b], len(text))
        return new


def chunks(start: Callable, advance: Callable, tokenizer) -> Iterator[StreamChunk]:
    """start() -> the state after the prefill; advance(state) -> the state a chunk later.
    Yields the tokens each call committed until every sequence is done."""
    state = start()
    seen = None
    while True:
        out = jax.device_get(state.out)  # before `advance` donates the state's buffers
        tokens, counts, done = map(np.asarray, (out.tokens, out.num_tokens, out.done))
        if seen is None:
            seen, deltas = np.zeros_like(counts), TextDeltas(tokenizer, len(counts))
        stats = getattr(state, "stats", None)
        yield StreamChunk(
            tokens=[tokens[b, seen[b]:n].tolist() for b, n in enumerate(counts)],
            texts=[deltas(b, tokens[b, :n].tolist(), bool(done[b])) if n > seen[b] else ""
                   for b, n in enumerate(counts)],
            done=done.tolist(), num_tokens=counts.tolist(),
            rounds=None if stats is None else np.asarray(stats.rounds).tolist())
        if np.all(done):
            return
        seen = counts
        state = advance(state)
