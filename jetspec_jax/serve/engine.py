"""Continuous batching: a fixed number of batch slots on the device, one decoding state for
all of them (the speculative or autoregressive state of `decode/`, ragged per row), and one
background thread that runs the device loop.

Active requests sit in slots 0..n-1. At a round boundary with no prefill under way, the
queued requests that fit the free slots start one prefill together (`Prefill`: their count
padded to a slot bucket, their prompts right-padded). Between two device calls of rounds the
thread runs one pass of at most `prefill_chunk` prompt tokens of that prefill, so a long prompt
delays the running requests by one pass per call, not by its whole prefill; after the last pass
the new requests' first tokens are chosen and their rows written into free slots. Then it runs
`chunk` rounds for the first `bucket(n)` slots in one compiled program (a few static slot
counts, so compiles stay few; the tree budget may differ per count), reads back the new tokens,
and evicts the finished, stopped and cancelled requests at once (the last active slot moves
into the hole, so the active slots stay a prefix). Each request has its own sampling options
and random stream (`RowSampler`), so its greedy tokens do not depend on its neighbours.

Paged (`EngineConfig.kv_block_size`), the slots' KV caches (the target's and the head's) are
one pool of blocks per layer (`cache.KVCache` with a table) and a host `BlockAllocator` gives
each request blocks as it grows: a row holds the blocks of its own tokens, not max_len's, so
more requests fit the same memory when they are short. Admission reserves each request's
worst case, the blocks of prompt + max_tokens + what one device call writes ahead: a queued
request joins (in arrival order) only when a slot is free and the blocks reserved by the
requests in slots and in the prefill leave room for its own. Rows then take blocks only as they
grow, before each device call (`speculative.slots_ahead`), which never reaches past a
reservation, so no row ever waits for a block and nothing is preempted; a request gives its
blocks and reservation back the moment it ends. Arrivals get their prompts' blocks when their
prefill starts and each pass writes into them through the state's pools; a head's context is
started in a pool of its own and its blocks copied into the state's when they join.
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
from jetspec_jax.decode.autoregressive import prefill_carry
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import RowSampler
from jetspec_jax.decode.speculative import slots_ahead, working_slots
from jetspec_jax.model.blocks import BlockAllocator
from jetspec_jax.model.cache import KVCache, Paging, retable
from jetspec_jax.options import PREFILL_CHUNK
from jetspec_jax.serve import programs as P
from jetspec_jax.serve.metrics import Metrics

log = logging.getLogger("jetspec.serve")
# A prefill pass is `prefill_chunk` tokens wide, or what is left rounded up to a multiple of
# this: few compiled passes whatever the prompts.
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
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill pass between device calls
    kv_block_size: int | None = None  # paged KV caches in blocks of this many slots (a
    #                                   multiple of 16, as the GPU kernels read them); None: dense
    kv_blocks: int | None = None  # the pool's blocks (the null block aside); None: as many as
    #                               max_batch dense rows hold

    def __post_init__(self):
        for name in ("max_batch", "max_len", "max_queue", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        size = self.kv_block_size
        if size is not None and (size < 16 or size % 16):
            raise ValueError(f"kv_block_size must be a multiple of 16 (the paged GPU kernels "
                             f"read whole tiles of 16 slots), got {size}")
        if self.kv_blocks is not None and (size is None or self.kv_blocks < 1):
            raise ValueError(f"kv_blocks={self.kv_blocks} needs kv_block_size and >= 1 blocks")
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


# ---- the engine ------------------------------------------------------------------------------


def _greedy_rows(n: int) -> dict[str, np.ndarray]:
    """The sampling options of n greedy rows, as `RowSampler`'s fields."""
    return dict(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32))


def _row_sampler(rows: dict[str, np.ndarray]) -> RowSampler:
    """The `RowSampler` of rows' sampling options (`_greedy_rows`' fields)."""
    return RowSampler(**{k: jnp.asarray(v) for k, v in rows.items()})


@dataclasses.dataclass(eq=False)
class Prefill:
    """Arrivals prefilled together, a pass at a time: their prompts [B, S] (B a slot bucket,
    rows past the requests are padding), the cache (paged: their block table, the pools being
    the state's) and last hidden states carried between passes, the taps of each pass, and how
    many prompt tokens have run."""

    requests: list[Request]
    prompt: np.ndarray
    lens: np.ndarray
    cache: object
    last: jax.Array
    taps: list = dataclasses.field(default_factory=list)
    done: int = 0

    @property
    def longest(self) -> int:
        return int(self.lens.max())


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
                kernels, target.mesh)[0] for n in self.buckets}
        extra = 1 if draft is None else max(
            working_slots(s.budget, draft.dcfg.block_size)
            for s in self.specs.values())
        self.num_slots = api.bucket(self.max_len + extra, 128)
        paging = self._paging(config)
        self.static = dict(tcfg=target.cfg, dcfg=draft and draft.dcfg, loop=Loop(
            max_new=self.max_len, num_slots=self.num_slots, stop_ids=self.stop_ids,
            kernels=kernels, cache_dtype=jnp.dtype(target.dtype), paging=paging))
        self.pool = paging and BlockAllocator(paging)
        self.reserved: dict[Request, int] = {}  # paged: blocks held for each admitted request
        b = config.max_batch
        self.rows = _greedy_rows(b)
        self.taps = () if draft is None else draft.dcfg.tap_layers  # what prefill passes keep
        self.state = self._empty_state()
        self.slots: list[Request] = []  # the active requests, slot i = index i
        self.prefill: Prefill | None = None  # the arrivals being prefilled
        self.queue: collections.deque[Request] = collections.deque()
        self.wake = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        self._gauge_blocks()

    def _paging(self, config: EngineConfig) -> Paging | None:
        """The pool's shape (None: dense rows); rounds num_slots up to whole blocks and sets
        how far ahead of its tokens a row's blocks must reach before a device call."""
        size = config.kv_block_size
        if size is None:
            return None
        self.num_slots = -(-self.num_slots // size) * size
        self.ahead = self.chunk if self.draft is None else slots_ahead(
            max(s.budget for s in self.specs.values()), self.draft.dcfg.block_size, self.chunk)
        blocks = config.kv_blocks or config.max_batch * self.num_slots // size
        if blocks < (need := self._worst_case(self.max_len, size)):
            raise ValueError(
                f"kv_blocks (--kv-blocks) = {blocks} cannot hold one request of max_len="
                f"{self.max_len} tokens: it needs {need} blocks of {size} slots (its tokens and "
                f"the {self.ahead} slots a device call writes ahead of them)")
        return Paging(size, blocks + 1)  # + the null block

    def _worst_case(self, tokens: int, block_size: int) -> int:
        """Blocks a request of `tokens` prompt + max_tokens may hold before it ends."""
        return -(-min(tokens + self.ahead, self.num_slots) // block_size)

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
        with api.on_mesh(self.target):
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
        cache, last = jax.eval_shape(self._dense_carry(b))
        shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        taps = (jax.ShapeDtypeStruct((b, 1, len(self.taps) * last.shape[-1]), last.dtype),
                ) if self.taps else ()
        loop = self.static["loop"]
        shapes = jax.eval_shape(
            functools.partial(P.new_rows, **dict(self.static, loop=dataclasses.replace(
                loop, paging=None))), self.tparams, self.dparams, cache, last,
            taps, shape(b, self.num_slots), shape(b), jax.random.split(jax.random.key(0), b),
            _row_sampler(self.rows))
        if loop.paging is not None:  # every table entry the null block: no row holds any
            shapes = jax.tree.map(lambda x: P.pool_shape(x, loop.paging) if P.is_cache(x) else x,
                                  shapes, is_leaf=P.is_cache)

        def zeros():
            state = jax.tree.map(
                lambda s: (jax.random.split(jax.random.key(0), s.shape[0])
                           if jnp.issubdtype(s.dtype, jax.dtypes.prng_key)
                           else jnp.zeros(s.shape, s.dtype)), shapes)
            return state.replace(out=state.out.replace(done=jnp.ones((b,), bool)))

        return api.zeros_on_mesh(zeros, self.target)

    def _run_round(self, active: int):
        return P.advance(self.tparams, self.dparams, self.state, _row_sampler(self.rows),
                        active=active, tree_spec=self.specs[active], chunk=self.chunk,
                        **self.static)

    def _loop(self) -> None:
        with api.on_mesh(self.target):  # the programs are traced with the target's mesh
            self._serve()

    def _serve(self) -> None:
        while True:
            with self.wake:
                while self.running and not (self.queue or self.slots or self.prefill):
                    self.wake.wait()
                if not self.running:
                    break
            try:  # a failed prefill fails its requests only
                self._admit()
                if self.prefill is not None:
                    self._prefill_pass()
            except Exception as e:  # noqa: BLE001
                log.exception("prefill failed")
                for r in self.prefill.requests if self.prefill else ():
                    self._finish(r, None, f"prefill failed: {e}")
                self.prefill = None
            self._gauge_slots()  # the rows this call decodes, while it runs
            try:
                if self.slots:
                    self._step()
            except Exception as e:  # noqa: BLE001  a failed round fails its requests only
                log.exception("decoding round failed")
                # paged, a prefill under way has written into the pools reset here: it fails too
                lost = self.prefill.requests if self.prefill and self.pool is not None else []
                for r in [*self.slots, *lost]:
                    self._finish(r, None, f"decoding failed: {e}")
                self.slots = []
                self.prefill = None if lost else self.prefill
                self.state = self._empty_state()
            self._gauge_slots()
        for r in [*self.slots, *(self.prefill.requests if self.prefill else ()), *self.queue]:
            self._finish(r, None, "the server is shutting down")

    def _gauge_slots(self) -> None:
        self.metrics.set("slots_active", len(self.slots))
        self.metrics.set("prefilling", len(self.prefill.requests) if self.prefill else 0)
        self._gauge_blocks()

    def _gauge_blocks(self) -> None:
        if self.pool is not None:
            free = self.pool.num_free
            self.metrics.set("kv_blocks_reserved", sum(self.reserved.values()))
            self.metrics.set("kv_blocks_free", free)
            self.metrics.set("kv_blocks_used", self.pool.paging.num_blocks - 1 - free)

    def _admit(self) -> None:
        """Ends a prefill whose requests have all been cancelled; with no prefill under way,
        starts one for the queued requests that fit the free slots."""
        if self.prefill is not None and all(r.cancel_reason for r in self.prefill.requests):
            dropped, self.prefill = self.prefill.requests, None
            for r in dropped:
                self._finish(r, r.cancel_reason, None)
        if self.prefill is not None:
            return
        taken = []
        with self.wake:
            while (self.queue and len(taken) < self.config.max_batch - len(self.slots)
                   and self._reserve(self.queue[0])):
                taken.append(self.queue.popleft())
            self.metrics.set("queue_depth", len(self.queue))
        for r in taken:
            if r.cancel_reason is not None:
                self._finish(r, r.cancel_reason, None)
        if taken := [r for r in taken if r.cancel_reason is None]:
            n = next(b for b in self.buckets if b >= len(taken))
            prompt = np.full((n, self.num_slots), self.pad_id, np.int32)
            lens = np.ones(n, np.int32)  # padding rows: one token
            for i, r in enumerate(taken):
                prompt[i, :len(r.ids)], lens[i] = r.ids, len(r.ids)
            # Held before its carry is made: if that fails (device memory), the loop's prefill
            # handler fails these requests and frees their blocks.
            self.prefill = Prefill(taken, prompt, lens, None, None)
            self.prefill.cache, self.prefill.last = self._carry(n, taken)

    def _table(self, requests) -> np.ndarray:
        """The block table of these requests' rows (None: a row with no blocks)."""
        return self.pool.table(requests, self.num_slots)

    def _reserve(self, r: Request) -> bool:
        """Paged: holds r's worst case of blocks if the pool has them beside the other
        requests' reservations (always true dense)."""
        if self.pool is None:
            return True
        need = self._worst_case(len(r.ids) + r.max_tokens, self.pool.paging.block_size)
        if sum(self.reserved.values()) + need > self.pool.paging.num_blocks - 1:
            return False
        self.reserved[r] = need
        return True

    def _release(self, r: Request) -> None:
        """r's blocks and reservation back to the pool (a request that had none: nothing)."""
        if self.pool is not None:
            self.pool.free(r)
            self.reserved.pop(r, None)

    def _grow(self) -> None:
        """Paged: gives each active row the blocks the next device call may write to (within
        its reservation: it has fewer than max_tokens tokens) and puts the table in the state;
        rows past the active ones hold none."""
        if self.pool is None:
            return
        for r in self.slots:  # the row's cache holds at most its prompt and `sent` tokens
            self.pool.grow(r, min(len(r.ids) + r.sent + self.ahead, self.num_slots))
        pad = [None] * (self.config.max_batch - len(self.slots))
        self.state = retable(self.state, self._table([*self.slots, *pad]))

    def _carry(self, n: int, requests: list[Request]):
        """The empty cache and last hidden states a prefill of n rows (requests, then padding)
        starts from. Paged, the requests' prompts get their blocks and the cache is their
        table, with no pools: each pass borrows the state's (`_lend`)."""
        make = self._dense_carry(n)
        if self.pool is None:
            return api.zeros_on_mesh(make, self.target)
        for r in requests:
            self.pool.grow(r, len(r.ids))
        table = self._table([*requests, *[None] * (n - len(requests))])
        last = jax.eval_shape(make)[1]
        return (KVCache(k=[], v=[], lengths=jnp.zeros((n,), jnp.int32),
                        table=jnp.asarray(table)),
                api.zeros_on_mesh(lambda: jnp.zeros(last.shape, last.dtype), self.target))

    def _dense_carry(self, n: int):
        """() -> the dense cache and last hidden states of a prefill of n rows."""
        return functools.partial(prefill_carry, self.tparams, self.target.cfg, n,
                                 self.static["loop"])

    def _lend(self, cache: KVCache) -> KVCache:
        """A paged prefill's cache holding the state's pools: the pass that takes it (donated)
        writes into them, and `_take_back` returns them to the state."""
        return cache if self.pool is None else cache.replace(k=self.state.cache.k,
                                                             v=self.state.cache.v)

    def _take_back(self, cache: KVCache) -> KVCache:
        if self.pool is None:
            return cache
        self.state = self.state.replace(cache=self.state.cache.replace(k=cache.k, v=cache.v))
        return cache.replace(k=[], v=[])

    def _prefill_pass(self) -> None:
        """One pass of the prefill under way (`PREFILL_STEP`), within the cache; the last
        one joins its requests."""
        p = self.prefill
        width = min(self.config.prefill_chunk, self.num_slots - p.done,
                    -(-(p.longest - p.done) // PREFILL_STEP) * PREFILL_STEP)
        cache, p.last, taps = P.prefill_chunk(
            self.tparams, self._lend(p.cache), p.last,
            jnp.asarray(p.prompt[:, p.done:p.done + width]),
            jnp.int32(p.done), jnp.asarray(p.lens), tcfg=self.target.cfg, taps=self.taps,
            kernels=self.static["loop"].kernels)
        p.cache = self._take_back(cache)
        if taps is not None:
            p.taps.append(taps)
        p.done += width
        self.metrics.count("prefill_tokens", width * len(p.lens))
        if p.done >= p.longest:
            self._join(p)
            self.prefill = None

    def _join(self, p: Prefill) -> None:
        """The prefilled requests take the next free slots; one cancelled meanwhile ends
        here (its row is dropped)."""
        n = len(p.lens)
        live = [r for r in p.requests if r.cancel_reason is None]
        slots = np.full(n, self.config.max_batch, np.int32)  # past the last slot: dropped
        rows = _greedy_rows(n)  # padding rows stay greedy
        for i, r in enumerate(p.requests):
            if r in live:
                slots[i] = len(self.slots) + live.index(r)
            for k, v in (("temperature", r.temperature), ("top_k", r.top_k), ("top_p", r.top_p)):
                rows[k][i] = v
        seeds = [r.seed if r.seed is not None else int.from_bytes(os.urandom(8), "little")
                 for r in p.requests]
        self.state = P.write_rows(
            self.tparams, self.dparams, self.state, p.cache, p.last, tuple(p.taps),
            jnp.asarray(p.prompt), jnp.asarray(p.lens),
            jnp.stack([_key(s) for s in seeds + [0] * (n - len(seeds))]),
            _row_sampler(rows), jnp.asarray(slots),
            **self.static)
        for i, r in enumerate(p.requests):
            if r not in live:
                self._finish(r, r.cancel_reason, None)
                continue
            for k, v in rows.items():
                self.rows[k][slots[i]] = v[i]
            self.slots.append(r)
            self.metrics.count("prompt_tokens", len(r.ids))

    def _step(self) -> None:
        n = len(self.slots)
        active = next(b for b in self.buckets if b >= n)
        self._grow()
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
            self.state = P.evict(self.state, jnp.int32(i), jnp.int32(last))
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
        self._release(r)
        self.metrics.count("requests", outcome=reason or "error")
        try:
            r.on_event([], reason, error)
        except Exception:  # noqa: BLE001  a listener that has gone away
            log.exception("could not deliver the end of a request")
