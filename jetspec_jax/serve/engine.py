"""Continuous batching: a fixed number of batch slots on the device, one decoding state for
all of them (the speculative or autoregressive state of `decode/`, ragged per row), and one
background thread that runs the device loop.

Active requests sit in slots 0..n-1. At each round boundary the thread admits queued requests
into free slots (a jitted prefill of one sequence written into its slot), runs `chunk` rounds
for the first `bucket(n)` slots in one compiled program (a few static slot counts, so compiles
stay few; the tree budget may differ per count), reads back the new tokens, and evicts the
finished, stopped and cancelled requests at once (the last active slot moves into the hole, so
the active slots stay a prefix). Each request has its own sampling options and random stream
(`RowSampler`), so its greedy tokens do not depend on its neighbours.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import api
from jetspec_jax.decode.autoregressive import ar_continue, prefill_state
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import RowSampler
from jetspec_jax.decode.speculative import init_state, spec_continue, working_slots
from jetspec_jax.serve.metrics import Metrics

log = logging.getLogger("jetspec.serve")
# Prompts are padded to a multiple of this before their prefill: one compiled prefill per
# multiple, so a server sees few compiles whatever its prompts.
PREFILL_STEP = 64


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # batch slots on the device
    max_len: int = 2048  # prompt + generated tokens of one request, at most
    budget: int | str | None = None  # tree nodes per round, "auto"; None: `api.default_budget`
    chunk: int | None = None  # rounds (steps without a head) per device call; None: 4
    max_queue: int = 64  # requests waiting for a slot, at most
    attn_impl: str = "auto"  # the attention kernel's name (`jetspec_jax.model.kernels`)
    slot_buckets: tuple[int, ...] | None = None  # active-slot counts compiled for; None: auto
    ngram: int | None = None  # context n-gram chain per tree, tokens at most
    #                           (`TreeSpec.ngram`); None: the head's default (`api.default_tree`)

    def __post_init__(self):
        for name in ("max_batch", "max_len", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        b = self.slot_buckets
        if b is not None and (list(b) != sorted(set(b)) or b[0] < 1 or b[-1] != self.max_batch):
            raise ValueError(f"slot buckets must be increasing counts >= 1 ending at max_batch "
                             f"{self.max_batch}, got {b}")


def slot_buckets(max_batch: int) -> tuple[int, ...]:
    """The active-slot counts programs are compiled for: powers of 4 below max_batch, and it."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 4
    return (*sizes, max_batch)


@dataclasses.dataclass(eq=False)
class Request:
    """One generation. on_event(tokens, finish, error) is called from the engine thread: new
    token ids, then a finish reason ("stop", "length", "cancelled") or an error message."""

    ids: list[int]
    max_tokens: int
    on_event: Callable[[list[int], str | None, str | None], None]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    cancel_reason: str | None = None  # set from any thread; the slot is freed next boundary
    sent: int = 0  # tokens delivered
    rounds: int = 0
    accepted: int = 0
    arrived: float = dataclasses.field(default_factory=time.perf_counter)

    def cancel(self, reason: str = "cancelled") -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason


def _key(seed: int) -> jax.Array:
    """A random key from a 64-bit signed seed, every seed its own stream (`jax.random.key`
    keeps only the low 32 bits without x64): the high 32 bits are folded in when set, so seeds
    below 2**32 give `jax.random.key(seed)`."""
    seed %= 2**64
    key = jax.random.key(seed % 2**32)
    return jax.random.fold_in(key, seed >> 32) if seed >> 32 else key


# ---- device programs -------------------------------------------------------------------------

_STATIC = ("tcfg", "dcfg", "loop")


def _start(tparams, dparams, prompt, lens, key, rows, *, tcfg, dcfg, loop: Loop):
    """The state of a batch after its prefill (speculative with a head, else autoregressive)."""
    if dcfg is None:
        return prefill_state(tparams, tcfg, prompt, lens, key, rows, loop)[0]
    return init_state(tparams, tcfg, dparams, dcfg, prompt, lens, key, sampler=rows, loop=loop)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames="state")
def _insert(tparams, dparams, state, slot, prompt, lens, key, rows, **static):
    """Prefills one sequence (prompt [1, P]) and writes its state into row `slot`."""
    one = _start(tparams, dparams, prompt, lens, key, rows, **static)
    return jax.tree.map(lambda full, x: full.at[slot].set(x[0]), state, one)


@functools.partial(jax.jit, donate_argnames="state")
def _evict(state, hole, last):
    """Row `last` moves into row `hole`; row `last` is then marked done (free)."""
    state = jax.tree.map(lambda x: x.at[hole].set(x[last]), state)
    return state.replace(out=state.out.replace(done=state.out.done.at[last].set(True)))


@functools.partial(jax.jit, static_argnames=(*_STATIC, "active", "tree_spec", "chunk"),
                   donate_argnames="state")
def _advance(tparams, dparams, state, rows, *, active, tcfg, dcfg, tree_spec, chunk,
             loop: Loop):
    """`chunk` rounds for rows 0..active-1 -> (state, what the host reads back)."""
    head = jax.tree.map(lambda x: x[:active], state)
    sampler = rows.rows(0, active)
    if dcfg is None:
        head = ar_continue(tparams, head, cfg=tcfg, sampler=sampler, loop=loop,
                           max_steps=chunk)
        rounds = accepted = jnp.zeros((active,), jnp.int32)
    else:
        head = spec_continue(tparams, dparams, head, tcfg=tcfg, dcfg=dcfg, tree_spec=tree_spec,
                             sampler=sampler, loop=loop, max_rounds=chunk)
        rounds, accepted = head.stats.rounds, jnp.sum(head.stats.accepted, axis=1)
    view = (head.out.tokens, head.out.num_tokens, head.out.done, rounds, accepted)
    if active < state.out.done.shape[0]:
        return jax.tree.map(lambda full, h: full.at[:active].set(h), state, head), view
    return head, view


# ---- the engine ------------------------------------------------------------------------------


class Engine:
    def __init__(self, target: api.Target, draft: api.Draft | None, config: EngineConfig,
                 metrics: Metrics | None = None):
        if draft is not None:
            api.check_fits(draft, target)
        self.target, self.draft, self.config = target, draft, config
        self.metrics = metrics or Metrics()
        self.metrics.set("slots_total", config.max_batch)
        self.max_len = min(config.max_len, target.cfg.max_position_embeddings)
        opts = api.decoding_options(budget=config.budget, attn_impl=config.attn_impl,
                                    ngram=config.ngram, draft=draft)
        kernels = api.resolve_kernels(target, opts.attn_impl, opts.matmul_impl, target.mesh)
        self.buckets = config.slot_buckets or slot_buckets(config.max_batch)
        # 4 per call: the host's per-call work costs about as much as a round of a small
        # model on a GPU (docs/serving.md)
        self.chunk = config.chunk or 4
        tok = target.tokenizer
        self.stop_ids = tuple(int(s) for s in (tok and tok.eos_token_ids)
                              or target.cfg.eos_token_ids)
        self.pad_id = tok.pad_id if tok is not None else 0
        self.tparams, self.dparams = target.params, draft and draft.params
        self.specs = {n: opts.tree_spec for n in self.buckets}
        if draft is not None and opts.auto:  # the tree size follows the active-slot count
            context = min(256, self.max_len)
            self.specs = {n: api.adaptive_spec(
                target, draft, self.tparams, self.dparams,
                jax.ShapeDtypeStruct((n, context), jnp.int32), opts.tree_spec,
                kernels, None)[0] for n in self.buckets}
        extra = 1 if draft is None else max(
            working_slots(s.budget, draft.dcfg.block_size)
            for s in self.specs.values())
        self.num_slots = api.bucket(self.max_len + extra, 128)
        self.static = dict(tcfg=target.cfg, dcfg=draft and draft.dcfg, loop=Loop(
            max_new=self.max_len, num_slots=self.num_slots, stop_ids=self.stop_ids,
            kernels=kernels, cache_dtype=jnp.dtype(target.dtype)))
        b = config.max_batch
        self.rows = dict(temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32),
                         top_p=np.ones(b, np.float32))
        self.state = self._empty_state()
        self.slots: list[Request] = []  # the active requests, slot i = index i
        self.queue: collections.deque[Request] = collections.deque()
        self.wake = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None

    # ---- host side API (any thread) ----

    def check(self, ids: list[int], max_tokens: int, field: str = "prompt",
              limit: str = "max_tokens", top_k: int = 0) -> None:
        """Raises ValueError(param, message) if the request cannot run in a slot: `field` names
        the prompt, `limit` the generated-token limit."""
        if not ids:
            raise ValueError(field, f"{field} is empty")
        if max_tokens > self.max_len - 1:
            raise ValueError(limit, f"{limit}={max_tokens} leaves no room for a prompt in the "
                             f"context limit of {self.max_len} tokens (at most "
                             f"{self.max_len - 1})")
        if len(ids) + max_tokens > self.max_len:
            raise ValueError(field, f"{field} has {len(ids)} tokens; with {limit}="
                             f"{max_tokens} that exceeds the context limit of {self.max_len} "
                             f"tokens (at most {self.max_len - max_tokens} prompt tokens fit)")
        vocab = self.target.cfg.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(field, f"{field} has token ids {bad[:5]} outside the vocab of "
                             f"{vocab}")
        if top_k > vocab:
            raise ValueError("top_k", f"top_k={top_k} exceeds the vocab of {vocab}")

    def submit(self, request: Request) -> None:
        with self.wake:
            if len(self.queue) >= self.config.max_queue:
                self.metrics.count("rejected", reason="queue_full")
                raise QueueFull(f"the queue holds {self.config.max_queue} waiting requests")
            self.queue.append(request)
            self.metrics.set("queue_depth", len(self.queue))
            self.wake.notify()

    def start(self) -> None:
        """Compiles the round programs (one per active-slot bucket), then starts the thread."""
        for n in self.buckets:
            self.state, _ = self._run_round(n)
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="jetspec-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.wake:
            self.running = False
            self.wake.notify()
        if self.thread is not None:
            self.thread.join()

    # ---- the device loop (engine thread) ----

    def _empty_state(self):
        b = self.config.max_batch
        rows = RowSampler(**{k: jnp.asarray(v) for k, v in self.rows.items()})
        shapes = jax.eval_shape(functools.partial(_start, **self.static),
                                self.tparams, self.dparams, jax.ShapeDtypeStruct((b, 1), jnp.int32),
                                jax.ShapeDtypeStruct((b,), jnp.int32),
                                jax.random.split(jax.random.key(0), b), rows)
        state = jax.tree.map(
            lambda s: (jax.random.split(jax.random.key(0), s.shape[0])
                       if jnp.issubdtype(s.dtype, jax.dtypes.prng_key)
                       else jnp.zeros(s.shape, s.dtype)), shapes)
        return state.replace(out=state.out.replace(done=jnp.ones((b,), bool)))

    def _row_sampler(self) -> RowSampler:
        return RowSampler(**{k: jnp.asarray(v) for k, v in self.rows.items()})

    def _run_round(self, active: int):
        return _advance(self.tparams, self.dparams, self.state, self._row_sampler(),
                        active=active, tree_spec=self.specs[active], chunk=self.chunk,
                        **self.static)

    def _loop(self) -> None:
        while True:
            with self.wake:
                while self.running and not self.queue and not self.slots:
                    self.wake.wait()
                if not self.running:
                    break
            try:
                self._admit()
                self._gauge_slots()  # the rows this call decodes, while it runs
                if self.slots:
                    self._step()
            except Exception as e:  # noqa: BLE001  a failed round fails its requests only
                log.exception("decoding round failed")
                for r in self.slots:
                    self._finish(r, None, f"decoding failed: {e}")
                self.slots = []
                self.state = self._empty_state()
            self._gauge_slots()
        for r in [*self.slots, *self.queue]:
            self._finish(r, None, "the server is shutting down")

    def _gauge_slots(self) -> None:
        self.metrics.set("slots_active", len(self.slots))

    def _admit(self) -> None:
        while len(self.slots) < self.config.max_batch:
            with self.wake:
                if not self.queue:
                    return
                r = self.queue.popleft()
                self.metrics.set("queue_depth", len(self.queue))
            if r.cancel_reason is not None:
                self._finish(r, r.cancel_reason, None)
                continue
            try:
                self._insert(r, len(self.slots))
            except Exception as e:  # noqa: BLE001  a request that cannot start fails alone
                log.exception("prefill failed")
                self._finish(r, None, f"prefill failed: {e}")
                continue
            self.slots.append(r)
            self.metrics.count("prompt_tokens", len(r.ids))

    def _insert(self, r: Request, slot: int) -> None:
        width = min(-(-len(r.ids) // PREFILL_STEP) * PREFILL_STEP, self.max_len)
        prompt = np.full((1, max(width, len(r.ids))), self.pad_id, np.int32)
        prompt[0, :len(r.ids)] = r.ids
        for k, v in (("temperature", r.temperature), ("top_k", r.top_k), ("top_p", r.top_p)):
            self.rows[k][slot] = v
        seed = r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little")
        rows = RowSampler(**{k: jnp.asarray(v[slot:slot + 1]) for k, v in self.rows.items()})
        self.state = _insert(self.tparams, self.dparams, self.state, jnp.int32(slot),
                             jnp.asarray(prompt), jnp.asarray([len(r.ids)], jnp.int32),
                             _key(seed)[None], rows, **self.static)

    def _step(self) -> None:
        n = len(self.slots)
        active = next(b for b in self.buckets if b >= n)
        self.state, view = self._run_round(active)
        tokens, nums, done, rounds, accepted = jax.device_get(view)
        self._count_rounds(rounds[:n], accepted[:n])
        finished = []
        for i, r in enumerate(self.slots):
            end = min(int(nums[i]), r.max_tokens)
            new = tokens[i, r.sent:end].tolist()
            r.sent, r.rounds, r.accepted = end, int(rounds[i]), int(accepted[i])
            reason = r.cancel_reason
            if reason is None and done[i] and int(nums[i]) <= r.max_tokens and (
                    tokens[i, end - 1] in self.stop_ids):
                reason = "stop"
            elif reason is None and end >= r.max_tokens:
                reason = "length"
            elif reason is None and done[i]:
                reason = "length"  # cannot happen: max_tokens <= max_len, the loop's limit
            self.metrics.count("generated_tokens", len(new))
            if new and reason != "cancelled":
                r.on_event(new, None, None)
            if reason is not None:
                finished.append(i)
                self._finish(r, reason, None)
        for i in reversed(finished):  # the last slot fills each hole: slots stay a prefix
            last = len(self.slots) - 1
            self.state = _evict(self.state, jnp.int32(i), jnp.int32(last))
            for v in self.rows.values():
                v[i] = v[last]
            self.slots[i] = self.slots[last]
            self.slots.pop()

    def _count_rounds(self, rounds: np.ndarray, accepted: np.ndarray) -> None:
        """Counts the rounds the last call ran for the active rows (per-row totals, against
        what each row had) and the tokens they committed; sets that call's tokens per round."""
        ran = int(rounds.sum()) - sum(r.rounds for r in self.slots)
        committed = int(accepted.sum()) - sum(r.accepted for r in self.slots)
        if ran:
            self.metrics.count("rounds", ran)
            self.metrics.count("accepted_tokens", committed)
            self.metrics.set("round_tokens", committed / ran)

    def _finish(self, r: Request, reason: str | None, error: str | None) -> None:
        self.metrics.count("requests", outcome=reason or "error")
        try:
            r.on_event([], reason, error)
        except Exception:  # noqa: BLE001  a listener that has gone away
            log.exception("could not deliver the end of a request")
