"""The one interface between a draft head and the speculative round (`decode.speculative`):
every drafter serves the same round, so the round, its verification and its statistics are
written once. A head's config (static under jit) picks its drafter (`of`), by its type.

  start(dparams, dcfg, tparams, prompt, prompt_lens, prompt_taps, *, num_slots, cache_dtype,
        paging, table)
      -> (draft cache, pending taps [B, blk, k*D], pending count [B]): the draft context after
      the prefill, and what the first round still has to add to it; paging and table: the
      target cache's blocks (None: dense), which a cache of the context may share
  draft(dparams, dcfg, tparams, tcfg, state, active, *, tree_spec, kernels, need_tree=None)
      -> (tree, draft cache): the round's tree after `state.anchor`, with the tokens
      committed by the last round (`state.pending_*`) added to the context first;
      need_tree, a traced bool, is False when the round will not use the tree (the context
      chain takes its whole budget): a drafter may then skip drafting it

The block head (`head.py`: causal = JetSpec, bidirectional = DFlash) is registered here;
other heads register their config type with `register` (the lab's baselines do so when
`lab` is imported).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from jetspec_jax.draft.tree import build_trees, root_trees, topk_from_logits
from jetspec_jax.draft import head as draft_head
from jetspec_jax.draft.head import DraftConfig
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels


class HeadConfig(Protocol):
    """What the round reads of a head's config (frozen and hashable: static under jit)."""

    tap_layers: tuple[int, ...]  # target layers whose hidden states the head reads

    @property
    def block_size(self) -> int: ...  # tokens a round commits at most

    @property
    def depth(self) -> int: ...  # draft depths: block_size - 1


class Drafter(Protocol):
    def start(self, dparams, dcfg, tparams, prompt, prompt_lens, prompt_taps, *,
              num_slots: int, cache_dtype, paging=None, table=None): ...

    def draft(self, dparams, dcfg, tparams, tcfg: ModelConfig, state, active, *, tree_spec,
              kernels: Kernels, need_tree=None): ...


class BlockDrafter:
    """One head forward drafts every depth's distribution; the tree is built from them. Its
    context holds the taps of the committed tokens: a round adds those of the last one's."""

    @staticmethod
    def start(dparams, dcfg: DraftConfig, tparams, prompt, prompt_lens, prompt_taps, *,
              num_slots: int, cache_dtype, paging=None, table=None):
        b = prompt.shape[0]
        cache = draft_head.allocate_cache(dcfg, b, num_slots, cache_dtype, paging, table)
        cache = draft_head.extend_context(dparams, dcfg, cache, prompt_taps, prompt_lens)
        pending = jnp.zeros((b, dcfg.block_size, prompt_taps.shape[-1]), prompt_taps.dtype)
        return cache, pending, jnp.zeros((b,), jnp.int32)

    @staticmethod
    def draft(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, state, active, *,
              tree_spec, kernels: Kernels, need_tree=None):
        cache = draft_head.extend_context(dparams, dcfg, state.draft_cache, state.pending_taps,
                                          jnp.where(active, state.pending_count, 0))

        def head_tree():
            logits = draft_head.draft_block(dparams, dcfg, tparams, tcfg, cache, state.anchor,
                                            depths=tree_spec.draft_depths(dcfg.depth),
                                            kernels=kernels)
            topk_lp, topk_tok = topk_from_logits(logits, tree_spec.draft_width)
            if dcfg.draft_vocab is not None:  # columns of the draft vocabulary -> token ids
                topk_tok = draft_head.vocab_ids(dcfg)[topk_tok]
            return build_trees(state.anchor, topk_lp, topk_tok, budget=tree_spec.budget,
                               method=tree_spec.method)

        if need_tree is None:
            return head_tree(), cache
        # The head's forward and LM head are most of a small round's draft on the CPU.
        empty = lambda: root_trees(state.anchor, tree_spec.budget)  # noqa: E731
        return jax.lax.cond(need_tree, head_tree, empty), cache


_DRAFTERS: dict[type, Drafter] = {DraftConfig: BlockDrafter()}


def register(config_type: type, drafter: Drafter) -> None:
    """Heads of config_type draft with drafter (a head outside the core plugs in here)."""
    _DRAFTERS[config_type] = drafter


def of(dcfg: HeadConfig) -> Drafter:
    """The drafter of a head, by its config's type."""
    try:
        return _DRAFTERS[type(dcfg)]
    except KeyError:
        raise TypeError(f"no drafter registered for {type(dcfg).__name__} heads; import the "
                        "module that registers it (`draft.drafter.register`)") from None
