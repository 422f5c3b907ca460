"""EAGLE-style autoregressive draft head: the baseline that pays one draft forward per depth.

One decoder layer (the target's width, heads and MLP) reads, at position t, the pair
(feature of position t-1, token t) fused by a linear layer from [normed token embedding ;
feature] and predicts token t+1 with the target's LM head. Features are the target's fused
taps (`fc` + `hidden_norm`) for committed positions and the layer's own output hidden state
for drafted ones, so depth d+1 is conditioned on its exact branch (EAGLE-2/3 style dynamic
tree, trained with the unrolled "training-time test").

Drafting a round with anchor x_p (position p, not yet in the context):
  1. the committed tokens since the last round (the anchor last) are appended to the context;
     the anchor's output is the root's hidden state -> top-K depth-1 candidates;
  2. for j = 1..D-1 the W best candidates of depth j (cumulative log-prob) are run as one
     batch of W queries at position p + j, each seeing the context and its own expanded
     ancestors, and each adds its top-K children;
  3. the `budget` best candidates (an ancestor-closed set: a child never outscores its parent)
     form the tree that the target verifies as in `speculative.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.decode.autoregressive import PREFILL_CHUNK, Output, check_capacity, prefill
from jetspec_jax.decode.sampling import Sampler, choose_tokens
from jetspec_jax.decode.speculative import SpecStats
from jetspec_jax.decode.tree import DraftTree, ancestor_matrix
from jetspec_jax.decode.verify import accept, commit, verify_tree
from jetspec_jax.draft import head as draft_head
from jetspec_jax.io.checkpoints import CheckpointError, carried_metadata, load_tree, save_tree
from jetspec_jax.io.shards import is_shard_export, read_shards, save_shards, unflatten
from jetspec_jax.model import target
from jetspec_jax.model.cache import KVCache, write_slots
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.layers import rms_norm
from jetspec_jax.model.params import ParamSpec, check_params, layer_specs
from jetspec_jax.train.head_forward import dense_attention
from pallas_kernels.tree_attention import cache_attention


KIND = "eagle_head"


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    layers: ModelConfig  # the one decoder layer's shape
    tap_layers: tuple[int, ...]
    depth: int = 6  # D: tree depth = draft forwards per round
    num_target_layers: int = 36

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


def save_eagle(path, eparams, ecfg: EagleConfig, *, metadata=None, overwrite=False,
               max_bytes=None):
    """max_bytes: as flat safetensors files of at most that size (`io/shards.py`)."""
    check_params(eparams, eagle_specs(ecfg), "EAGLE head params to save")
    if max_bytes is not None:
        return save_shards(path, eparams, ecfg.to_dict(), kind=KIND, metadata=metadata,
                           max_bytes=max_bytes, overwrite=overwrite)
    return save_tree(path, eparams, ecfg.to_dict(), kind=KIND, metadata=metadata,
                     overwrite=overwrite)


def load_eagle(path) -> tuple[EagleConfig, dict]:
    """-> (ecfg, eparams) of a `save_eagle` checkpoint (a directory, or its shard files)."""
    if not isinstance(path, (str, Path)) or (is_shard_export(path)
                                             and not (Path(path) / "metadata.json").exists()):
        kind, config, flat, _ = read_shards(path)
        if kind != KIND:
            raise CheckpointError(f"{path} holds a {kind!r} head, not an {KIND!r}")
        ecfg = EagleConfig.from_dict(config)
        return ecfg, unflatten(flat, eagle_specs(ecfg), f"EAGLE head {path}")
    eparams, config, _ = load_tree(path, kind=KIND)
    ecfg = EagleConfig.from_dict(config)
    check_params(eparams, eagle_specs(ecfg), f"EAGLE head {path}")
    return ecfg, eparams


def convert_eagle(src, dst, *, dtype=None, overwrite=False, max_bytes=None):
    """A `save_eagle` checkpoint cast to dtype (e.g. float32 -> bfloat16 to ship) at dst; its
    metadata (training settings) is kept."""
    ecfg, eparams = load_eagle(src)
    if dtype is not None:
        eparams = jax.tree.map(lambda a: a.astype(dtype), eparams)
    kept = (read_shards(src)[3] if not (Path(src) / "metadata.json").exists()
            else carried_metadata(src, KIND))
    return save_eagle(dst, eparams, ecfg, metadata={**kept, "source": str(src)},
                      overwrite=overwrite, max_bytes=max_bytes)


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


def _step(eparams, ecfg: EagleConfig, tparams, feats, tokens, positions, attend):
    """The layer on queries (feature of the previous position [B, Q, D], token [B, Q]) at
    positions [B, Q]. attend(q, k, v) -> (out [B, Q, N, H], aux) sees this step's rotated q, k
    and v. Returns (hidden [B, Q, D], aux)."""
    cfg = ecfg.layers
    emb = rms_norm(target.embed(tparams, tokens), eparams["embed_norm"], cfg.rms_norm_eps)
    x = jnp.concatenate([emb.astype(feats.dtype), feats], axis=-1) @ eparams["fuse"]
    return draft_head.draft_layer(eparams["layer"], cfg, x, positions, attend)


def _logits(eparams, ecfg: EagleConfig, tparams, tcfg: ModelConfig, hidden):
    return target.lm_head(tparams, tcfg, rms_norm(hidden, eparams["norm"],
                                                  ecfg.layers.rms_norm_eps))


def _shift(feats):
    """Feature of the previous position: [B, T, D] -> [B, T, D], zeros at position 0."""
    return jnp.pad(feats, ((0, 0), (1, 0), (0, 0)))[:, :-1]


# --- training: the unrolled chain along the data's own tokens ---------------------------------

def eagle_logits(eparams, ecfg: EagleConfig, tparams, tcfg: ModelConfig, taps, tokens, anchors):
    """Draft logits [B, A, D, V] for depths 1..D after each anchor [B, A], the path following
    tokens [B, T]; the same computation as drafting that path at inference."""
    b, t = tokens.shape
    a = anchors.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)
    causal = jnp.broadcast_to(pos[None, :, None] >= pos[None, None, :], (b, t, t))
    hid, (ck, cv) = _step(eparams, ecfg, tparams, _shift(fuse_taps(eparams, ecfg, taps)),
                          tokens, jnp.broadcast_to(pos, (b, t)),
                          lambda q, k, v: (dense_attention(q, k, v, causal), (k, v)))
    feat = jnp.take_along_axis(hid, anchors[:, :, None], axis=1)  # [B, A, D] root hidden
    ctx_visible = pos[None, None, :] <= anchors[:, :, None]  # [B, A, T]: up to the anchor
    own = jnp.eye(a, dtype=bool)[None]  # [1, A, A]: a chain sees only its own entries
    depth_hidden, chain_k, chain_v = [feat], [], []
    for j in range(1, ecfg.depth):
        positions = anchors + j
        tok = jnp.take_along_axis(tokens, jnp.minimum(positions, t - 1), axis=1)  # [B, A]

        def attend(q, k, v):
            keys = jnp.concatenate([ck, *chain_k, k], axis=1)
            vals = jnp.concatenate([cv, *chain_v, v], axis=1)
            vis = jnp.concatenate([ctx_visible] + [jnp.broadcast_to(own, (b, a, a))] * j, -1)
            return dense_attention(q, keys, vals, vis), (k, v)

        feat, (k, v) = _step(eparams, ecfg, tparams, feat, tok, positions, attend)
        chain_k.append(k)
        chain_v.append(v)
        depth_hidden.append(feat)
    hidden = jnp.stack(depth_hidden, axis=2)  # [B, A, D, D_model]
    return _logits(eparams, ecfg, tparams, tcfg, hidden.reshape(b, a * ecfg.depth, -1)).reshape(
        b, a, ecfg.depth, -1)


# --- inference ----------------------------------------------------------------------------------

def extend(eparams, ecfg: EagleConfig, tparams, cache: KVCache, taps_prev, tokens, count):
    """Appends entries (taps of the previous position [B, Q, k*D], token [B, Q]) to the
    context; the first count[b] are kept. Returns (cache, hidden [B, Q, D])."""
    start = cache.lengths
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)

    def attend(q, k, v):
        kc, vc = write_slots(cache.k[0], k, start), write_slots(cache.v[0], v, start)
        return cache_attention(q, kc, vc, start, None, impl="reference"), (kc, vc)

    hid, (kc, vc) = _step(eparams, ecfg, tparams, fuse_taps(eparams, ecfg, taps_prev), tokens,
                          positions, attend)
    return KVCache(k=[kc], v=[vc], lengths=start + count.astype(jnp.int32)), hid


def prompt_context(eparams, ecfg: EagleConfig, tparams, prompt_taps, prompt, prompt_lens,
                   num_slots: int) -> KVCache:
    """The context of prefilled prompts [B, P]: entries (taps of t-1, token t), t < prompt_lens."""
    c = ecfg.layers
    cache = KVCache.allocate(1, prompt.shape[0], c.num_kv_heads, num_slots, c.head_dim,
                             jnp.float32)
    return extend(eparams, ecfg, tparams, cache, _shift(prompt_taps), prompt, prompt_lens)[0]


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
        _logits(eparams, ecfg, tparams, tcfg, root_hidden[:, None])[:, 0]), w)  # [B, K]
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
        hid, (k, v) = _step(eparams, ecfg, tparams, f_feat, f_tok, positions, attend)
        buf_k.append(k)
        buf_v.append(v)
        clp, ctok = jax.lax.top_k(jax.nn.log_softmax(
            _logits(eparams, ecfg, tparams, tcfg, hid)), w)  # [B, W, K]
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


@flax.struct.dataclass
class EagleState:
    cache: KVCache
    eagle_cache: KVCache
    pending_tokens: jax.Array  # [B, D+1] committed since the last round, the anchor last
    pending_taps: jax.Array  # [B, D+1, k*D] taps of the position before each pending token
    pending_count: jax.Array  # [B]
    out: Output
    stats: SpecStats
    key: jax.Array


def eagle_round(tparams, tcfg, eparams, ecfg: EagleConfig, state: EagleState, *, budget, width,
                sampler, stop_ids, max_new) -> EagleState:
    active = ~state.out.done
    count = jnp.where(active, state.pending_count, 0)
    ecache, hid = extend(eparams, ecfg, tparams, state.eagle_cache, state.pending_taps,
                         state.pending_tokens, count)
    last = jnp.maximum(count - 1, 0)
    root_hidden = jnp.take_along_axis(hid, last[:, None, None], axis=1)[:, 0]
    anchor = jnp.take_along_axis(state.pending_tokens, last[:, None], axis=1)[:, 0]
    tree = draft_tree(eparams, ecfg, tparams, tcfg, ecache, root_hidden, anchor, budget=budget,
                      width=width)
    logits, cache, taps = verify_tree(tparams, tcfg, state.cache, tree, taps=ecfg.tap_layers)
    key, sub = jax.random.split(state.key)
    acc = accept(tree, choose_tokens(sub, logits, sampler), ecfg.depth)
    cache = commit(cache, acc, active)
    committed = acc.committed_tokens(tree)
    out = state.out.append(committed, acc.count, stop_ids, max_new)
    r = state.stats.rounds
    stats = SpecStats(rounds=r + active, accepted=jax.vmap(lambda row, i, v: row.at[i].set(v))(
        state.stats.accepted, jnp.minimum(r, state.stats.accepted.shape[1] - 1),
        jnp.where(active, acc.count, 0)))
    return EagleState(cache=cache, eagle_cache=ecache, pending_tokens=committed,
                      pending_taps=jnp.take_along_axis(taps, acc.path[:, :, None], axis=1),
                      pending_count=acc.count, out=out, stats=stats, key=key)


@functools.partial(jax.jit, static_argnames=(
    "tcfg", "ecfg", "budget", "width", "max_new", "sampler", "stop_ids", "num_slots",
    "prefill_chunk"))
def eagle_generate(tparams, eparams, prompt, prompt_lens, key, *, tcfg: ModelConfig,
                   ecfg: EagleConfig, budget: int, width: int, max_new: int, sampler: Sampler,
                   stop_ids: tuple[int, ...], num_slots: int,
                   prefill_chunk: int = PREFILL_CHUNK) -> tuple[Output, SpecStats]:
    """Speculative decoding with the EAGLE-style head (float32 caches); outputs as `ar_generate`."""
    b, plen = prompt.shape
    d = ecfg.depth
    check_capacity(plen, max_new, budget + d + 1, tcfg.max_position_embeddings, num_slots)
    cache = target.allocate_cache(tcfg, b, num_slots, jnp.float32)
    logits, cache, ptaps = prefill(tparams, tcfg, prompt, prompt_lens, cache,
                                   taps=ecfg.tap_layers, chunk=prefill_chunk)
    key, sub = jax.random.split(key)
    first = choose_tokens(sub, logits, sampler)
    out = Output.empty(b, max_new + d + 1).append(first[:, None], jnp.ones((b,), jnp.int32),
                                                   stop_ids, max_new)
    ecache = prompt_context(eparams, ecfg, tparams, ptaps, prompt, prompt_lens, num_slots)
    last_taps = jnp.take_along_axis(ptaps, (prompt_lens - 1)[:, None, None], axis=1)
    state = EagleState(
        cache=cache, eagle_cache=ecache,
        pending_tokens=jnp.zeros((b, d + 1), jnp.int32).at[:, 0].set(first),
        pending_taps=jnp.zeros((b, d + 1, ptaps.shape[-1]), ptaps.dtype).at[:, :1].set(last_taps),
        pending_count=jnp.ones((b,), jnp.int32), out=out,
        stats=SpecStats(rounds=jnp.zeros((b,), jnp.int32),
                        accepted=jnp.zeros((b, max_new), jnp.int32)), key=key)
    round_fn = functools.partial(eagle_round, tparams, tcfg, eparams, ecfg, budget=budget,
                                 width=width, sampler=sampler, stop_ids=stop_ids,
                                 max_new=max_new)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.out.done), round_fn, state)
    return state.out, state.stats
