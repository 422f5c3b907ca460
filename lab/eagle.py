"""The EAGLE-style autoregressive draft head: the baseline that pays one draft forward per
depth, as a drafter of the one speculative round (`jetspec_jax.decode.speculative`),
registered for its config type (`jetspec_jax.draft.drafter.register`).

One decoder layer (the target's width, heads and MLP) reads, at position t, the pair
(feature of position t-1, token t) fused by a linear layer from [normed token embedding ;
feature] and predicts token t+1 with the target's LM head. Features are the target's fused
taps (`fc` + `hidden_norm`) for committed positions and the layer's own output hidden state
for drafted ones, so depth d+1 is conditioned on its exact branch (EAGLE-2/3 style dynamic
tree, trained with the unrolled "training-time test", `eagle_training.py`).

Drafting a round with anchor x_p (position p, not yet in the context):
  1. the committed tokens since the last round (the anchor last) are appended to the context;
     the anchor's output is the root's hidden state -> top-K depth-1 candidates;
  2. for j = 1..D-1 the W best candidates of depth j (cumulative log-prob) are run as one
     batch of W queries at position p + j, each seeing the context and its own expanded
     ancestors, and each adds its top-K children;
  3. the `budget` best candidates (an ancestor-closed set: a child never outscores its parent)
     form the tree that the target verifies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jetspec_jax.draft.tree import DraftTree, ancestor_matrix
from jetspec_jax.draft import drafter, head as draft_head
from jetspec_jax.draft.head import dense_attention
from jetspec_jax.model import target
from jetspec_jax.model.cache import KVCache, write_slots
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.model.layers import rms_norm
from jetspec_jax.model.params import ParamSpec, layer_specs
from pallas_kernels.tree_attention import cache_attention


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    layers: ModelConfig  # the one decoder layer's shape
    tap_layers: tuple[int, ...]
    depth: int = 6  # D: tree depth = draft forwards per round
    num_target_layers: int = 36

    @property
    def block_size(self) -> int:
        """Tokens a round commits at most (D accepted drafts + the bonus token)."""
        return self.depth + 1

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layers": self.layers.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EagleConfig":
        return cls(**{**data, "layers": ModelConfig.from_dict(data["layers"]),
                      "tap_layers": tuple(data["tap_layers"])})


def eagle_config_for(tcfg: ModelConfig, *, num_taps: int = 3, depth: int = 6) -> EagleConfig:
    base = draft_head.draft_config_for(tcfg, num_layers=1, num_taps=num_taps)
    return EagleConfig(layers=base.layers, tap_layers=base.tap_layers, depth=depth,
                       num_target_layers=tcfg.num_layers)


def eagle_specs(ecfg: EagleConfig) -> dict:
    d, k = ecfg.layers.hidden_size, len(ecfg.tap_layers)
    return {
        "fc": ParamSpec((k * d, d), ("taps", "embed"), "normal", k * d),
        "hidden_norm": ParamSpec((d,), ("embed",), "ones"),
        "embed_norm": ParamSpec((d,), ("embed",), "ones"),
        "fuse": ParamSpec((2 * d, d), (None, "embed"), "normal", 2 * d),
        "layer": layer_specs(ecfg.layers, 0),
        "norm": ParamSpec((d,), ("embed",), "ones"),
    }


def fuse_taps(eparams, ecfg: EagleConfig, taps):
    """Target taps [B, T, k*D] -> features [B, T, D]."""
    x = jnp.einsum("BTF,FD->BTD", taps.astype(eparams["fc"].dtype), eparams["fc"])
    return rms_norm(x, eparams["hidden_norm"], ecfg.layers.rms_norm_eps)


def step(eparams, ecfg: EagleConfig, tparams, feats, tokens, positions, attend):
    """The layer on queries (feature of the previous position [B, Q, D], token [B, Q]) at
    positions [B, Q]. attend(q, k, v) -> (out [B, Q, N, H], aux) sees this step's rotated q, k
    and v. Returns (hidden [B, Q, D], aux)."""
    cfg = ecfg.layers
    emb = rms_norm(target.embed(tparams, tokens), eparams["embed_norm"], cfg.rms_norm_eps)
    x = jnp.concatenate([emb.astype(feats.dtype), feats], axis=-1) @ eparams["fuse"]
    return draft_head.draft_layer(eparams["layer"], cfg, x, positions, attend)


def logits(eparams, ecfg: EagleConfig, tparams, tcfg: ModelConfig, hidden):
    return target.lm_head(tparams, tcfg, rms_norm(hidden, eparams["norm"],
                                                  ecfg.layers.rms_norm_eps))


def shift(feats):
    """Feature of the previous position: [B, T, D] -> [B, T, D], zeros at position 0."""
    return jnp.pad(feats, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def extend(eparams, ecfg: EagleConfig, tparams, cache: KVCache, taps_prev, tokens, count):
    """Appends entries (taps of the previous position [B, Q, k*D], token [B, Q]) to the
    context; the first count[b] are kept. Returns (cache, hidden [B, Q, D])."""
    start = cache.lengths
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)

    def attend(q, k, v):
        kc, vc = write_slots(cache.k[0], k, start), write_slots(cache.v[0], v, start)
        return cache_attention(q, kc, vc, start, None, impl="reference"), (kc, vc)

    hid, (kc, vc) = step(eparams, ecfg, tparams, fuse_taps(eparams, ecfg, taps_prev), tokens,
                         positions, attend)
    return KVCache(k=[kc], v=[vc], lengths=start + count.astype(jnp.int32)), hid


def prompt_context(eparams, ecfg: EagleConfig, tparams, prompt_taps, prompt, prompt_lens,
                   num_slots: int, dtype=jnp.float32) -> KVCache:
    """The context of prefilled prompts [B, P]: entries (taps of t-1, token t), t < prompt_lens."""
    c = ecfg.layers
    cache = KVCache.allocate(1, prompt.shape[0], c.num_kv_heads, num_slots, c.head_dim, dtype)
    return extend(eparams, ecfg, tparams, cache, shift(prompt_taps), prompt, prompt_lens)[0]


def draft_tree(eparams, ecfg: EagleConfig, tparams, tcfg: ModelConfig, cache: KVCache,
               root_hidden, anchor, *, budget: int, width: int) -> DraftTree:
    """The dynamic tree after the anchor (already the last context entry) -> DraftTree [B, N].
    Each level expands its `width` best candidates, each adding its top-`width` children."""
    b, w = anchor.shape[0], width
    n_cand = 1 + w + (ecfg.depth - 1) * w * w
    if not 1 <= budget <= n_cand:
        raise ValueError(f"budget must be in [1, {n_cand}] for depth {ecfg.depth} and width "
                         f"{width}, got {budget}")
    p = cache.lengths - 1  # the anchor's position
    s = cache.num_slots
    ctx_k, ctx_v = cache.k[0].transpose(0, 2, 1, 3), cache.v[0].transpose(0, 2, 1, 3)
    ctx_vis = jnp.arange(s)[None, None, :] < cache.lengths[:, None, None]  # [B, 1, S]
    lp, tok = jax.lax.top_k(jax.nn.log_softmax(
        logits(eparams, ecfg, tparams, tcfg, root_hidden[:, None])[:, 0]), w)  # [B, K]
    # Candidates, level by level: token, parent (global index), depth, score.
    tokens, parents = [anchor[:, None], tok], [jnp.full((b, 1), -1), jnp.zeros((b, w), int)]
    depths, scores = [jnp.zeros((b, 1), int), jnp.ones((b, w), int)], [jnp.zeros((b, 1)), lp]
    level_start, feat = 1, jnp.broadcast_to(root_hidden[:, None], (b, w, root_hidden.shape[-1]))
    buf_k, buf_v, anc = [], [], jnp.zeros((b, w, 0), bool)  # anc: expanded ancestors per cand.
    for j in range(1, ecfg.depth):
        best = jax.lax.top_k(scores[-1], w)[1]  # [B, W] frontier among this level's candidates
        pick = lambda x: jnp.take_along_axis(x, best, axis=1)  # noqa: E731
        f_tok, f_score = pick(tokens[-1]), pick(scores[-1])
        f_feat = jnp.take_along_axis(feat, best[:, :, None], axis=1)
        f_anc = jnp.take_along_axis(anc, best[:, :, None], axis=1)  # [B, W, E]
        vis = jnp.concatenate([jnp.broadcast_to(ctx_vis, (b, w, s)), f_anc,
                               jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w))], -1)

        def attend(q, k, v):
            keys = jnp.concatenate([ctx_k, *buf_k, k], axis=1)
            vals = jnp.concatenate([ctx_v, *buf_v, v], axis=1)
            return dense_attention(q, keys, vals, vis), (k, v)

        positions = jnp.broadcast_to(p[:, None] + j, (b, w))
        hid, (k, v) = step(eparams, ecfg, tparams, f_feat, f_tok, positions, attend)
        buf_k.append(k)
        buf_v.append(v)
        clp, ctok = jax.lax.top_k(jax.nn.log_softmax(
            logits(eparams, ecfg, tparams, tcfg, hid)), w)  # [B, W, K]
        tokens.append(ctok.reshape(b, w * w))
        parents.append(jnp.repeat(level_start + best, w, axis=1))
        depths.append(jnp.full((b, w * w), j + 1))
        scores.append((f_score[:, :, None] + clp).reshape(b, w * w))
        level_start += tokens[-2].shape[1]
        feat = jnp.repeat(hid, w, axis=1)  # each child's feature: its parent's hidden
        self_slot = jnp.eye(w, dtype=bool)[None].repeat(b, 0)  # [B, W, W]
        anc = jnp.repeat(jnp.concatenate([f_anc, self_slot], -1), w, axis=1)
    return _select(*(jnp.concatenate(x, axis=1) for x in (tokens, parents, depths, scores)),
                   budget=budget, max_depth=ecfg.depth)


def _select(tokens, parents, depths, scores, *, budget: int, max_depth: int) -> DraftTree:
    """The budget best candidates [B, C] in index order (parents before children); top_k
    breaks score ties by lower index, i.e. parent first, so the set is ancestor-closed."""
    sel = jnp.sort(jax.lax.top_k(scores, budget)[1], axis=1)  # [B, N]
    pick = lambda x: jnp.take_along_axis(x, sel, axis=1)  # noqa: E731
    new_index = jax.vmap(lambda s: jnp.full(tokens.shape[1], -1).at[s].set(jnp.arange(budget)))(
        sel)
    par = pick(parents)
    par = jnp.where(par >= 0, jnp.take_along_axis(new_index, jnp.maximum(par, 0), axis=1), -1)
    return DraftTree(tokens=pick(tokens).astype(jnp.int32), parents=par.astype(jnp.int32),
                     depths=pick(depths).astype(jnp.int32),
                     scores=pick(scores).astype(jnp.float32),
                     valid=jnp.ones(sel.shape, bool),
                     ancestors=jax.vmap(lambda x: ancestor_matrix(x, max_depth))(par))


# ---- the drafter of the speculative round (`jetspec_jax.draft.drafter.Drafter`) -----------


class EagleDrafter:
    """Its context holds (feature, token) entries; a round first adds the entries of the
    tokens committed since the last one (the anchor last), then grows the tree depth by
    depth. No adaptive budget: the tree is its own."""

    @staticmethod
    def start(eparams, ecfg: EagleConfig, tparams, prompt, prompt_lens, prompt_taps, *,
              num_slots: int, cache_dtype, paging=None, table=None):
        del paging, table  # the dynamic tree reads its context whole: a dense cache
        cache = prompt_context(eparams, ecfg, tparams, prompt_taps, prompt, prompt_lens,
                               num_slots, cache_dtype)
        b = prompt.shape[0]
        last = jnp.take_along_axis(prompt_taps, (prompt_lens - 1)[:, None, None], axis=1)
        pending = jnp.zeros((b, ecfg.block_size, prompt_taps.shape[-1]), prompt_taps.dtype)
        return cache, pending.at[:, :1].set(last), jnp.ones((b,), jnp.int32)

    @staticmethod
    def draft(eparams, ecfg: EagleConfig, tparams, tcfg: ModelConfig, state, active, *,
              tree_spec, kernels: Kernels, need_tree=None):
        del kernels, need_tree  # the dynamic tree's attention is the dense reference
        if tree_spec.buckets:
            raise ValueError("the EAGLE-style head grows its own tree: a fixed budget only")
        count = jnp.where(active, state.pending_count, 0)
        out, blk = state.out, ecfg.block_size  # the committed tokens: the last count of out
        tokens = jax.vmap(lambda row, at: jax.lax.dynamic_slice(row, (at,), (blk,)))(
            out.tokens, out.num_tokens - state.pending_count)
        cache, hid = extend(eparams, ecfg, tparams, state.draft_cache, state.pending_taps,
                            tokens, count)
        root = jnp.take_along_axis(hid, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
        tree = draft_tree(eparams, ecfg, tparams, tcfg, cache, root, state.anchor,
                          budget=tree_spec.budget, width=tree_spec.width)
        return tree, cache


drafter.register(EagleConfig, EagleDrafter())
