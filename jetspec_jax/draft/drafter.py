"""The one interface between a draft head and the speculative round (`decode.speculative`):
every drafter serves the same round, so the round, its verification and its statistics are
written once. A head's config (static under jit) picks its drafter (`of`).

  start(dparams, dcfg, tparams, prompt, prompt_lens, prompt_taps, *, num_slots, cache_dtype)
      -> (draft cache, pending taps [B, blk, k*D], pending count [B]): the draft context after
      the prefill, and what the first round still has to add to it
  draft(dparams, dcfg, tparams, tcfg, state, active, *, tree_spec, kernels)
      -> (tree, draft cache): the round's tree after `state.anchor`, with the tokens
      committed by the last round (`state.pending_*`) added to the context first
  refine(dparams, dcfg, tparams, tcfg, draft cache, tree, *, tree_spec, kernels) -> tree:
      after the adaptive budget's choice, a second pass over the chosen tree (or none)

Drafters: the block head (`head.py`: causal = JetSpec, bidirectional = DFlash; with
`draft_mode="path"` its path-conditioned pass, `path.py`) and the EAGLE-style head
(`eagle.py`).
"""

from __future__ import annotations

from typing import Protocol

import jax.numpy as jnp

from jetspec_jax.decode.tree import build_trees, topk_from_logits
from jetspec_jax.draft import head as draft_head, path as path_draft
from jetspec_jax.draft.eagle import EagleConfig, EagleDrafter
from jetspec_jax.draft.head import DraftConfig
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels

HeadConfig = DraftConfig | EagleConfig


class Drafter(Protocol):
    def start(self, dparams, dcfg, tparams, prompt, prompt_lens, prompt_taps, *,
              num_slots: int, cache_dtype): ...

    def draft(self, dparams, dcfg, tparams, tcfg: ModelConfig, state, active, *, tree_spec,
              kernels: Kernels): ...

    def refine(self, dparams, dcfg, tparams, tcfg: ModelConfig, cache, tree, *, tree_spec,
               kernels: Kernels): ...


class BlockDrafter:
    """One head forward drafts every depth's distribution; the tree is built from them. Its
    context holds the taps of the committed tokens: a round adds those of the last one's."""

    @staticmethod
    def start(dparams, dcfg: DraftConfig, tparams, prompt, prompt_lens, prompt_taps, *,
              num_slots: int, cache_dtype):
        b = prompt.shape[0]
        cache = draft_head.allocate_cache(dcfg, b, num_slots, cache_dtype)
        cache = draft_head.extend_context(dparams, dcfg, cache, prompt_taps, prompt_lens)
        pending = jnp.zeros((b, dcfg.block_size, prompt_taps.shape[-1]), prompt_taps.dtype)
        return cache, pending, jnp.zeros((b,), jnp.int32)

    @staticmethod
    def draft(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, state, active, *,
              tree_spec, kernels: Kernels):
        cache = draft_head.extend_context(dparams, dcfg, state.draft_cache, state.pending_taps,
                                          jnp.where(active, state.pending_count, 0))
        logits = draft_head.draft_block(dparams, dcfg, tparams, tcfg, cache, state.anchor,
                                        depths=tree_spec.draft_depths(dcfg.depth),
                                        kernels=kernels)
        topk_lp, topk_tok = topk_from_logits(logits, tree_spec.draft_width)
        if dcfg.draft_vocab is not None:  # columns of the draft vocabulary -> token ids
            topk_tok = draft_head.vocab_ids(dcfg)[topk_tok]
        tree = build_trees(state.anchor, topk_lp, topk_tok, budget=tree_spec.budget,
                           method=tree_spec.method)
        return tree, cache

    @staticmethod
    def refine(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, cache, tree, *,
               tree_spec, kernels: Kernels):
        if tree_spec.draft_mode != "path":
            return tree
        return path_draft.refine_trees(dparams, dcfg, tparams, tcfg, cache, tree,
                                       width=tree_spec.draft_width, kernels=kernels)


def of(dcfg: HeadConfig) -> Drafter:
    """The drafter of a head, by its config's type."""
    return EagleDrafter() if isinstance(dcfg, EagleConfig) else BlockDrafter()
