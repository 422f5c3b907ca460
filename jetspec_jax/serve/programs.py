"""The continuous-batching engine's compiled device programs (`engine.Engine` drives them):
one prefill chunk of a group of arrivals, their rows' first decoding state written into free
slots, `chunk` rounds for the active slots, and the eviction of a finished row. A paged
cache's pools are shared by every row, so per-row updates go through `rowwise`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jetspec_jax.decode.autoregressive import (ar_continue, first_token, prefill_logits,
                                               prefill_pass)
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.speculative import from_prefill, spec_continue
from jetspec_jax.model.cache import KVCache, Paging, copy_blocks

STATIC = ("tcfg", "dcfg", "loop")


def is_cache(x) -> bool:
    return isinstance(x, KVCache)


def rowwise(fn, state, *rest):
    """fn over the per-row leaves of decoding states (batch first). A paged cache's pools hold
    every row's blocks, not rows: they are the last state's, and its lengths and table are
    per row."""
    def one(x, *ys):
        if not (is_cache(x) and x.table is not None):
            return jax.tree.map(fn, x, *ys)
        return (ys[-1] if ys else x).replace(lengths=fn(x.lengths, *(y.lengths for y in ys)),
                                             table=fn(x.table, *(y.table for y in ys)))

    return jax.tree.map(one, state, *rest, is_leaf=is_cache)


@functools.partial(jax.jit, static_argnames=("tcfg", "taps", "kernels"),
                   donate_argnames=("cache", "last"))
def prefill_chunk(tparams, cache, last, tokens, start, lens, *, tcfg, taps, kernels):
    """One prefill pass of a group of arrivals (`prefill_pass`)."""
    return prefill_pass(tparams, tcfg, tokens, start, lens, cache, last, taps=taps,
                        kernels=kernels)


def new_rows(tparams, dparams, cache, last, taps, prompt, lens, key, rows, *, tcfg, dcfg,
          loop: Loop):
    """The decoding state of prefilled rows (speculative with a head, else autoregressive):
    their first tokens, and with a head the draft context of their taps (one [B, C, k*D] per
    pass). prompt [B, S]: the prompts padded to the cache's slots."""
    logits, cache = prefill_logits(tparams, tcfg, last, lens, cache, loop.kernels)
    if dcfg is None:
        return first_token(logits, cache, key, rows, loop)
    ar = first_token(logits, cache, key, rows, loop, slack=dcfg.block_size)
    return from_prefill(ar, tparams, dparams, dcfg, prompt, lens,
                        jnp.concatenate(taps, axis=1) if taps else None, loop)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames="state")
def write_rows(tparams, dparams, state, cache, last, taps, prompt, lens, key, rows, slots,
                *, loop: Loop, **static):
    """Writes the prefilled rows into rows `slots` of the state (a slot past the last one
    drops its row: padding, or a request cancelled while it was prefilled). Paged, `cache` is
    the rows' block table over the state's pools (`engine.Engine._lend`)."""
    if loop.paging is not None:
        cache = cache.replace(k=state.cache.k, v=state.cache.v)
    new = new_rows(tparams, dparams, cache, last, taps, prompt, lens, key, rows, loop=loop,
                **static)
    if loop.paging is not None and getattr(new, "draft_cache", None) is not None:
        new = new.replace(draft_cache=copy_blocks(state.draft_cache, new.draft_cache,
                                                  cache.table))
    return rowwise(lambda full, x: full.at[slots].set(x, mode="drop"), state, new)


@functools.partial(jax.jit, donate_argnames="state")
def evict(state, hole, last):
    """Row `last` moves into row `hole`; row `last` is then marked done (free)."""
    state = rowwise(lambda x: x.at[hole].set(x[last]), state)
    return state.replace(out=state.out.replace(done=state.out.done.at[last].set(True)))


@functools.partial(jax.jit, static_argnames=(*STATIC, "active", "tree_spec", "chunk"),
                   donate_argnames="state")
def advance(tparams, dparams, state, rows, *, active, tcfg, dcfg, tree_spec, chunk,
             loop: Loop):
    """`chunk` rounds for rows 0..active-1 -> (state, what the host reads back)."""
    head = rowwise(lambda x: x[:active], state)
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
        return rowwise(lambda full, h: full.at[:active].set(h), state, head), view
    return head, view


def pool_shape(rows: KVCache, paging: Paging) -> KVCache:
    """The shape of a paged cache of these dense rows' layers and batch."""
    b, k, s, h = rows.k[0].shape

    def pool(x):
        return jax.ShapeDtypeStruct((paging.num_blocks, k, paging.block_size, h), x.dtype)

    return rows.replace(k=[pool(x) for x in rows.k], v=[pool(x) for x in rows.v],
                        table=jax.ShapeDtypeStruct((b, s // paging.block_size), jnp.int32))
