"""The speculative loop: prefill, then rounds of draft -> tree -> verify -> accept -> commit,
all inside one jitted `lax.while_loop` with no host round trip."""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax import draft_head, target
from jetspec_jax.cache import KVCache
from jetspec_jax.config import ModelConfig
from jetspec_jax.decode import Output, check_capacity, prefill
from jetspec_jax.draft_head import DraftConfig
from jetspec_jax.sampling import Sampler, choose_tokens
from jetspec_jax.tree import METHODS, build_trees, topk_from_logits
from jetspec_jax.verify import accept, commit, verify_tree

MAX_BUDGET = 1024


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """How each round's tree is drafted: `budget` nodes (root included), fan-out `width`."""

    budget: int = 64
    width: int = 7
    method: str = "accum_logp"

    def __post_init__(self):
        if not 1 <= self.budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in [1, {MAX_BUDGET}], got {self.budget}")
        if self.width < 1:
            raise ValueError(f"tree width must be >= 1, got {self.width}")
        if self.method not in METHODS:
            raise ValueError(f"unknown tree method {self.method!r}; choose from {METHODS}")


def working_slots(budget: int, block_size: int) -> int:
    """Cache slots a speculative run needs beyond prompt + max_new: the tree is written after
    the committed tokens each round, and the last round may overshoot max_new by a block."""
    return max(budget, block_size) + block_size


@flax.struct.dataclass
class SpecStats:
    rounds: jax.Array  # [B] rounds run per sequence
    accepted: jax.Array  # [B, R] tokens committed in each round (accepted drafts + 1)


@flax.struct.dataclass
class SpecState:
    cache: KVCache
    draft_cache: KVCache
    anchor: jax.Array  # [B] last committed token, not yet in the target cache
    pending_taps: jax.Array  # [B, blk, k*D] taps of the last round's committed tokens
    pending_count: jax.Array  # [B]
    out: Output
    stats: SpecStats
    key: jax.Array


def speculative_round(tparams, tcfg: ModelConfig, dparams, dcfg: DraftConfig, state: SpecState, *,
                      tree_spec: TreeSpec, sampler: Sampler, stop_ids, max_new: int,
                      attn_impl: str) -> SpecState:
    active = ~state.out.done
    dcache = draft_head.extend_context(dparams, dcfg, state.draft_cache, state.pending_taps,
                                       jnp.where(active, state.pending_count, 0))
    draft_logits = draft_head.draft_block(dparams, dcfg, tparams, tcfg, dcache, state.anchor,
                                          attn_impl=attn_impl)
    width = 1 if tree_spec.method == "chain" else tree_spec.width
    topk_lp, topk_tok = topk_from_logits(draft_logits, width)
    tree = build_trees(state.anchor, topk_lp, topk_tok, budget=tree_spec.budget,
                       method=tree_spec.method)
    logits, cache, taps = verify_tree(tparams, tcfg, state.cache, tree,
                                      taps=dcfg.tap_layers, attn_impl=attn_impl)
    key, sub = jax.random.split(state.key)
    acc = accept(tree, choose_tokens(sub, logits, sampler), dcfg.depth)
    cache = commit(cache, acc, active)
    out = state.out.append(acc.committed_tokens(tree), acc.count, stop_ids, max_new)
    r = state.stats.rounds
    stats = SpecStats(
        rounds=r + active,
        accepted=jax.vmap(lambda row, i, v: row.at[i].set(v))(
            state.stats.accepted, jnp.minimum(r, state.stats.accepted.shape[1] - 1),
            jnp.where(active, acc.count, 0)))
    pending = jnp.take_along_axis(taps, acc.path[:, :, None], axis=1)
    return SpecState(cache=cache, draft_cache=dcache, anchor=acc.bonus, pending_taps=pending,
                     pending_count=acc.count, out=out, stats=stats, key=key)


def init_state(tparams, tcfg: ModelConfig, dparams, dcfg: DraftConfig, prompt, prompt_lens, key,
               *, max_new: int, sampler: Sampler, stop_ids, num_slots: int, attn_impl: str,
               cache_dtype) -> SpecState:
    """Prefill: the target reads the prompts (with taps), picks the first token, and the draft
    context is filled with the prompts' taps."""
    b = prompt.shape[0]
    blk = dcfg.block_size
    cache = target.allocate_cache(tcfg, b, num_slots, cache_dtype)
    logits, cache, prompt_taps = prefill(tparams, tcfg, prompt, prompt_lens, cache,
                                         taps=dcfg.tap_layers, attn_impl=attn_impl)
    key, sub = jax.random.split(key)
    first = choose_tokens(sub, logits, sampler)
    out = Output.empty(b, max_new + blk).append(first[:, None], jnp.ones((b,), jnp.int32),
                                                 stop_ids, max_new)
    dcache = draft_head.allocate_cache(dcfg, b, num_slots, cache_dtype)
    dcache = draft_head.extend_context(dparams, dcfg, dcache, prompt_taps, prompt_lens)
    return SpecState(
        cache=cache, draft_cache=dcache, anchor=first,
        pending_taps=jnp.zeros((b, blk, prompt_taps.shape[-1]), prompt_taps.dtype),
        pending_count=jnp.zeros((b,), jnp.int32), out=out,
        stats=SpecStats(rounds=jnp.zeros((b,), jnp.int32),
                        accepted=jnp.zeros((b, max_new), jnp.int32)),
        key=key)


@functools.partial(jax.jit, static_argnames=(
    "tcfg", "dcfg", "tree_spec", "max_new", "sampler", "stop_ids", "num_slots", "attn_impl",
    "cache_dtype"))
def spec_generate(tparams, dparams, prompt, prompt_lens, key, *, tcfg: ModelConfig,
                  dcfg: DraftConfig, tree_spec: TreeSpec, max_new: int, sampler: Sampler,
                  stop_ids: tuple[int, ...], num_slots: int, attn_impl: str = "reference",
                  cache_dtype=jnp.float32) -> tuple[Output, SpecStats]:
    """Speculative decoding of a right-padded batch; same outputs as `ar_generate` (greedy:
    token for token; sampling: in distribution)."""
    check_capacity(prompt.shape[1], max_new, working_slots(tree_spec.budget, dcfg.block_size),
                   tcfg.max_position_embeddings, num_slots)
    state = init_state(tparams, tcfg, dparams, dcfg, prompt, prompt_lens, key, max_new=max_new,
                       sampler=sampler, stop_ids=stop_ids, num_slots=num_slots,
                       attn_impl=attn_impl, cache_dtype=cache_dtype)
    round_fn = functools.partial(speculative_round, tparams, tcfg, dparams, dcfg,
                                 tree_spec=tree_spec, sampler=sampler, stop_ids=stop_ids,
                                 max_new=max_new, attn_impl=attn_impl)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.out.done), round_fn, state)
    return state.out, state.stats
