"""The speculative loop: prefill, then rounds of draft -> tree -> verify -> accept -> commit,
all inside one jitted `lax.while_loop` with no host round trip (`spec_generate`), or in chunks
of rounds that a host loop streams (`spec_start`, `spec_continue`).

One round serves every drafter (`draft/drafter.py`: the block head, JetSpec or DFlash, and
any drafter registered for its head's config), picked by the head's config.
`TreeSpec.buckets` picks each round's tree size on device (`adaptive.py`)."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.decode import adaptive
from jetspec_jax.decode.autoregressive import (
    ARState,
    Output,
    check_capacity,
    loop_until_done,
    prefill_state,
)
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import RowSampler, Sampler, choose_tokens, split_key
from jetspec_jax.decode.verify import accept, commit, verify_tree
from jetspec_jax.draft import drafter as drafters, ngram
from jetspec_jax.draft.drafter import HeadConfig
from jetspec_jax.model.cache import KVCache
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.sharding import constrain_state

from jetspec_jax.draft.tree_spec import TreeSpec


def working_slots(budget: int, block_size: int) -> int:
    """Cache slots a speculative run needs beyond prompt + max_new: the tree is written after
    the committed tokens each round, and the last round may overshoot max_new by a block."""
    return max(budget, block_size) + block_size


def slots_ahead(budget: int, block_size: int, rounds: int) -> int:
    """Slots past a row's committed length that the next `rounds` rounds may write (what a
    paged row needs, `blocks.BlockAllocator.grow`): each commits at most block_size tokens,
    the last writes its tree of up to budget + 1 nodes after them."""
    return (rounds - 1) * block_size + working_slots(budget, block_size)


@flax.struct.dataclass
class SpecStats:
    rounds: jax.Array  # [B] rounds run per sequence
    accepted: jax.Array  # [B, R] tokens committed in each round (accepted drafts + 1)
    nodes: jax.Array | None = None  # [B, R] tree size verified in each round


@flax.struct.dataclass
class SpecState:
    cache: KVCache
    draft_cache: KVCache  # the drafter's context
    anchor: jax.Array  # [B] last committed token, not yet in the target cache
    pending_taps: jax.Array  # [B, blk, k*D] taps of the positions the last round committed
    #                          (the old anchor and the accepted drafts), not yet in the context
    pending_count: jax.Array  # [B] how many of them; the tokens are the last ones of `out`
    out: Output
    stats: SpecStats
    key: jax.Array
    prompt: jax.Array  # [B, S] the prompts, zero-padded to the cache's slots, and
    prompt_lens: jax.Array  # [B] their lengths: with `out`, the committed text (draft/ngram.py)


def speculative_round(tparams, tcfg: ModelConfig, dparams, dcfg: HeadConfig, state: SpecState,
                      *, tree_spec: TreeSpec, sampler: Sampler | RowSampler,
                      loop: Loop) -> SpecState:
    active = ~state.out.done
    kernels = loop.kernels
    drafter = drafters.of(dcfg)
    found = None  # the context chain (draft/ngram.py)
    if tree_spec.ngram:
        found = ngram.round_chain(state, tree_spec.ngram, dcfg.depth, tree_spec.budget)
    # A chain that takes the whole budget leaves the drafted tree no node: it need not be
    # drafted (chains come with a fixed budget only, so no bucket reads the tree's scores).
    full = None if found is None else ngram.fills_tree(*found, tree_spec.budget, active)
    need_tree = None if full is None else ~full
    tree, dcache = drafter.draft(dparams, dcfg, tparams, tcfg, state, active,
                                 tree_spec=tree_spec, kernels=kernels, need_tree=need_tree)
    if found is not None:
        tree = ngram.add_chain(tree, *found, dcfg.depth)

    def verify_round(tree):
        logits, cache, taps = verify_tree(tparams, tcfg, state.cache, tree,
                                          taps=dcfg.tap_layers, kernels=kernels)
        key, sub = split_key(state.key)
        acc = accept(tree, choose_tokens(sub, logits, sampler), dcfg.depth)
        cache = commit(cache, acc, active)
        out = state.out.append(acc.committed_tokens(tree), acc.count, loop.stop_ids,
                               loop.max_new)
        r = state.stats.rounds
        at = jnp.minimum(r, state.stats.accepted.shape[1] - 1)
        put = jax.vmap(lambda row, i, v: row.at[i].set(v))
        stats = SpecStats(rounds=r + active,
                          accepted=put(state.stats.accepted, at, jnp.where(active, acc.count, 0)),
                          nodes=put(state.stats.nodes, at,
                                    jnp.where(active, tree.tokens.shape[1], 0)))
        pending = taps if taps is None else jnp.take_along_axis(taps, acc.path[:, :, None], 1)
        return state.replace(cache=cache, draft_cache=dcache, anchor=acc.bonus,
                             pending_taps=pending, pending_count=acc.count, out=out, stats=stats,
                             key=key)

    if tree_spec.buckets:
        return adaptive.switch_budget(tree, active, tree_spec.buckets, tree_spec.bucket_costs,
                                      verify_round)
    return verify_round(tree)


def init_state(tparams, tcfg: ModelConfig, dparams, dcfg: HeadConfig, prompt, prompt_lens, key,
               table=None, *, sampler: Sampler | RowSampler, loop: Loop) -> SpecState:
    """The autoregressive start (`prefill_state`: the target reads the prompts with taps and
    picks the first token), then `from_prefill`."""
    ar, prompt_taps = prefill_state(tparams, tcfg, prompt, prompt_lens, key, sampler, loop,
                                    taps=dcfg.tap_layers, slack=dcfg.block_size, table=table)
    return from_prefill(ar, tparams, dparams, dcfg, prompt, prompt_lens, prompt_taps, loop)


def from_prefill(ar: ARState, tparams, dparams, dcfg: HeadConfig, prompt, prompt_lens,
                 prompt_taps, loop: Loop) -> SpecState:
    """The speculative state of prefilled prompts (`ar`, its output with `dcfg.block_size`
    slack): the draft context filled with the prompts' taps (paged in the target cache's
    table when it is paged)."""
    b = prompt.shape[0]
    dcache, pending_taps, pending_count = drafters.of(dcfg).start(
        dparams, dcfg, tparams, prompt, prompt_lens, prompt_taps, num_slots=loop.num_slots,
        cache_dtype=loop.cache_dtype, paging=loop.paging, table=ar.cache.table)
    zeros = jnp.zeros((b, loop.max_new), jnp.int32)
    return constrain_state(SpecState(
        cache=ar.cache, draft_cache=dcache, anchor=ar.last, pending_taps=pending_taps,
        pending_count=pending_count, out=ar.out,
        stats=SpecStats(rounds=jnp.zeros((b,), jnp.int32), accepted=zeros, nodes=zeros),
        key=ar.key, prompt=jnp.pad(prompt, ((0, 0), (0, loop.num_slots - prompt.shape[1]))),
        prompt_lens=prompt_lens))


def spec_start(tparams, dparams, prompt, prompt_lens, key, table=None, *, tcfg: ModelConfig,
               dcfg: HeadConfig, tree_spec: TreeSpec, sampler: Sampler,
               loop: Loop) -> SpecState:
    """Checks that the batch fits, then `init_state`."""
    check_capacity(prompt.shape[1], loop.max_new,
                   working_slots(tree_spec.budget, dcfg.block_size),
                   tcfg.max_position_embeddings, loop.num_slots)
    return init_state(tparams, tcfg, dparams, dcfg, prompt, prompt_lens, key, table,
                      sampler=sampler, loop=loop)


def spec_continue(tparams, dparams, state: SpecState, *, tcfg: ModelConfig, dcfg: HeadConfig,
                  tree_spec: TreeSpec, sampler: Sampler | RowSampler, loop: Loop,
                  max_rounds: int | None = None) -> SpecState:
    """Speculative rounds until every sequence is done, or max_rounds of them."""
    round_fn = functools.partial(speculative_round, tparams, tcfg, dparams, dcfg,
                                 tree_spec=tree_spec, sampler=sampler, loop=loop)
    # The carry's caches stay sharded by KV head on a mesh (no-op without one).
    return loop_until_done(lambda s: constrain_state(round_fn(s)), state, max_rounds,
                           working_slots(tree_spec.budget, dcfg.block_size))


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "tree_spec", "sampler", "loop"))
def spec_generate(tparams, dparams, prompt, prompt_lens, key, table=None, *, tcfg: ModelConfig,
                  dcfg: HeadConfig, tree_spec: TreeSpec, sampler: Sampler,
                  loop: Loop) -> tuple[Output, SpecStats]:
    """Speculative decoding of a right-padded batch; same outputs as `ar_generate` (greedy:
    token for token; sampling: in distribution). table: the paged cache's block table
    (loop.paging), each row's blocks holding at least prompt + max_new + `working_slots`."""
    static = dict(tcfg=tcfg, dcfg=dcfg, tree_spec=tree_spec, sampler=sampler, loop=loop)
    state = spec_start(tparams, dparams, prompt, prompt_lens, key, table, **static)
    state = spec_continue(tparams, dparams, state, **static)
    return state.out, state.stats
