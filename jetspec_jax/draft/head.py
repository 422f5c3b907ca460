"""The causal parallel draft head: one forward drafts distributions for all depths 1..B-1.

Context: hidden states tapped from k target layers, concatenated [T, k*D], projected by `fc`
and RMS-normed. Block: [anchor, MASK x (B-1)] embedded with the target's embedding. Every
draft layer takes queries from the normed block states and keys/values from
[context ; block]; the same projected context feeds every layer. Inside the block slot i sees
slots <= i (causal) or every slot (bidirectional, the DFlash baseline). The target's LM head
turns block slots 1..B-1 into the draft distributions q_1..q_{B-1}; a head with a draft
vocabulary (`DraftConfig.draft_vocab`, the most frequent answer tokens) uses only those rows of
it, so its logits cost a fraction of the full vocabulary's and its trees hold only those tokens.
Verification stays over the full vocabulary, so decoding stays lossless.

The context K/V of every draft layer is cached (a `KVCache`, paged in the target cache's blocks
when that one is) and extended each round with the newly committed tokens' taps, so a round
only projects the new tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jetspec_jax.model import target
from jetspec_jax.model.cache import KVCache, Paging, write_slots
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.model.layers import project, rms_norm, rope
from jetspec_jax.model.params import ParamSpec, layer_specs
from pallas_kernels.tree_attention import cache_attention
from pallas_kernels.tree_attention.reference import masked_attention


def default_tap_layers(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Evenly spread layer ids from 1 to L-3 (outputs of those 0-based target layers)."""
    if num_taps == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A draft head's shape; `layers` is a ModelConfig for the head's own decoder layers."""

    layers: ModelConfig  # hidden size, heads, MLP width, rope, eps of the head's layers
    block_size: int = 16
    tap_layers: tuple[int, ...] = (1, 9, 17, 25, 33)
    mask_token_id: int | None = None  # None: the head owns a learned mask embedding
    causal: bool = True
    num_target_layers: int = 36
    draft_vocab: tuple[int, ...] | None = None  # token ids the head drafts; None: all

    def __post_init__(self):
        if self.draft_vocab is not None:  # a tuple, so the config stays hashable (jit static)
            object.__setattr__(self, "draft_vocab", tuple(int(i) for i in self.draft_vocab))

    @property
    def depth(self) -> int:
        return self.block_size - 1

    def check_target(self, tcfg: ModelConfig) -> None:
        """The one check that this head can serve the target `tcfg`: one ValueError naming
        every way it cannot (hidden size, number of target layers, tap layers, mask token,
        block size, draft vocabulary and, when the head records it, the vocabulary size)."""
        problems = []
        if self.layers.hidden_size != tcfg.hidden_size:
            problems.append(f"head hidden size {self.layers.hidden_size} != target hidden size "
                            f"{tcfg.hidden_size}")
        vocab = self.layers.vocab_size
        if vocab and vocab != tcfg.vocab_size:
            problems.append(f"head vocab size {vocab} != target vocab size {tcfg.vocab_size}")
        if self.num_target_layers != tcfg.num_layers:
            problems.append(f"head was made for a {self.num_target_layers}-layer target, this "
                            f"target has {tcfg.num_layers} layers")
        bad = [i for i in self.tap_layers if not 0 <= i < tcfg.num_layers]
        if bad:
            problems.append(f"tap layers {bad} are outside the target's 0..{tcfg.num_layers - 1}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < tcfg.vocab_size:
            problems.append(f"mask token id {self.mask_token_id} is outside the target vocab "
                            f"of {tcfg.vocab_size}")
        if self.block_size < 2:
            problems.append(f"block size must be >= 2, got {self.block_size}")
        if self.draft_vocab is not None:
            ids = np.asarray(self.draft_vocab)
            if not len(ids) or ids.min() < 0 or ids.max() >= tcfg.vocab_size:
                problems.append(f"draft vocabulary ids must lie in the target vocab of "
                                f"{tcfg.vocab_size} (got {len(ids)} ids)")
            elif len(np.unique(ids)) != len(ids):
                problems.append("draft vocabulary ids repeat")
        if problems:
            raise ValueError("draft head does not fit the target: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = self.layers.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DraftConfig":
        data = dict(data)
        data["layers"] = ModelConfig.from_dict(data["layers"])
        data["tap_layers"] = tuple(data["tap_layers"])
        return cls(**data)


def draft_config_for(tcfg: ModelConfig, *, num_layers=5, block_size=16, num_taps=5,
                     mask_token_id=None, causal=True, draft_vocab=None) -> DraftConfig:
    """A head shaped like the reference's: the target's width, heads and MLP, a few layers."""
    layers = tcfg.replace(name=f"{tcfg.name}-draft", num_layers=num_layers, qk_norm=True,
                          num_experts=0, experts_per_token=0, moe_intermediate_size=0,
                          moe_layers=None,
                          intermediate_size=tcfg.intermediate_size or 3 * tcfg.hidden_size)
    return DraftConfig(layers=layers, block_size=block_size,
                       tap_layers=default_tap_layers(tcfg.num_layers, num_taps),
                       mask_token_id=mask_token_id, causal=causal,
                       num_target_layers=tcfg.num_layers, draft_vocab=draft_vocab)


def draft_specs(dcfg: DraftConfig) -> dict:
    d = dcfg.layers.hidden_size
    k = len(dcfg.tap_layers)
    specs = {
        "fc": ParamSpec((k * d, d), ("taps", "embed"), "normal", k * d),
        "hidden_norm": ParamSpec((d,), ("embed",), "ones"),
        "layers": [layer_specs(dcfg.layers, i) for i in range(dcfg.layers.num_layers)],
        "norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if dcfg.mask_token_id is None:
        # std 1/sqrt(D), a token embedding's scale: a unit-variance vector would outweigh the
        # block's other inputs in the residual stream and every slot would draft the same token.
        specs["mask_embed"] = ParamSpec((d,), ("embed",), "normal", d)
    return specs


def allocate_cache(dcfg: DraftConfig, batch: int, num_slots: int, dtype,
                   paging: Paging | None = None, table=None) -> KVCache:
    """Dense, or paged with paging and table [batch, num_slots / block_size]."""
    c = dcfg.layers
    return KVCache.allocate(c.num_layers, batch, c.num_kv_heads, num_slots, c.head_dim, dtype,
                            paging, table)


def key_value(p, cfg: ModelConfig, x, positions):
    """A draft layer's K (k_norm, RoPE) and V for inputs x [B, T, D] at positions [B, T]."""
    k = rms_norm(project("BTD,DKH->BTKH", x, p["k"]), p["k_norm"], cfg.rms_norm_eps)
    v = project("BTD,DKH->BTKH", x, p["v"])
    return rope(k, positions, cfg.rope_theta), v


def draft_layer(p, cfg: ModelConfig, x, positions, attend):
    """One draft decoder layer over x [B, T, D] at positions [B, T] -> (x, aux): the one body
    that inference (`head_hidden`), training (`train.head_forward`) and the EAGLE-style head
    share. attend(q, k, v) -> (out [B, T, N, H], aux) gets this layer's normed, rotated
    q [B, T, N, H] and k, v [B, T, K, H] and decides what else they see (the cache, the dense
    training context, a branch's ancestors)."""
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q = rms_norm(project("BTD,DNH->BTNH", h, p["q"]), p["q_norm"], cfg.rms_norm_eps)
    q = rope(q, positions, cfg.rope_theta)
    k, v = key_value(p, cfg, h, positions)
    out, aux = attend(q, k, v)
    x = x + project("BTNH,NHD->BTD", out, p["o"])
    return x + target.mlp_block(p, cfg, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)), aux


def dense_attention(q, k, v, visible):
    """q [B, Q, N, H]; k, v [B, S, K, H]; visible [B, Q, S] -> [B, Q, N, H]; softmax in f32
    (the tree-attention reference under a dense mask): the `attend` of a draft layer whose
    keys are gathered whole (training, the EAGLE-style tree)."""
    return masked_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), visible)


def extend_context(dparams, dcfg: DraftConfig, cache: KVCache, taps, num_new) -> KVCache:
    """Adds the first num_new[b] rows of taps [B, T, k*D] to every draft layer's context K/V."""
    cfg = dcfg.layers
    ctx = rms_norm(project("BTF,FD->BTD", taps.astype(dparams["fc"].dtype), dparams["fc"]),
                   dparams["hidden_norm"], cfg.rms_norm_eps)
    positions = cache.lengths[:, None] + jnp.arange(taps.shape[1], dtype=jnp.int32)
    new_k, new_v = [], []
    for i, p in enumerate(dparams["layers"]):
        kc, vc = cache.layer(i)
        k, v = key_value(p, cfg, ctx, positions)
        new_k.append(write_slots(kc, k, cache.lengths))
        new_v.append(write_slots(vc, v, cache.lengths))
    return cache.with_layers(new_k, new_v).replace(
        lengths=cache.lengths + num_new.astype(jnp.int32))


def mask_inputs(dparams, dcfg: DraftConfig, tparams, shape):
    """MASK-slot embeddings [*shape, D]: the head's learned vector or the reserved token's."""
    if dcfg.mask_token_id is None:
        d = dparams["mask_embed"].shape[-1]
        return jnp.broadcast_to(dparams["mask_embed"].astype(tparams["embed"].dtype), (*shape, d))
    return target.embed(tparams, jnp.full(shape, dcfg.mask_token_id))


def block_inputs(dparams, dcfg: DraftConfig, tparams, anchor):
    """Embeddings [B, blk, D] of [anchor, MASK, ..., MASK]."""
    first = target.embed(tparams, anchor[:, None])
    mask = mask_inputs(dparams, dcfg, tparams, (anchor.shape[0], dcfg.block_size - 1))
    return jnp.concatenate([first, mask], axis=1)


def block_mask(dcfg: DraftConfig, batch: int):
    blk = dcfg.block_size
    inside = jnp.tril(jnp.ones((blk, blk), bool)) if dcfg.causal else jnp.ones((blk, blk), bool)
    return jnp.broadcast_to(inside, (batch, blk, blk))


def head_hidden(dparams, dcfg: DraftConfig, cache: KVCache, x, positions, mask, *,
                kernels: Kernels = Kernels()):
    """The draft layers over new slots x [B, T, D] at positions [B, T] against the cached
    context; mask [B, T, T] says which new slots each slot sees. -> final-normed states
    [B, T, D]. The new K/V are written after the context but lengths are not advanced, so the
    next round overwrites them."""
    cfg = dcfg.layers
    start = cache.lengths
    impl, interpret = kernels.cache_attention(), kernels.interpret
    for i, p in enumerate(dparams["layers"]):
        def attend(q, k, v, kv=cache.layer(i)):
            kc, vc = write_slots(kv[0], k, start), write_slots(kv[1], v, start)
            return cache_attention(q, kc, vc, start, mask, impl=impl, interpret=interpret), None

        x, _ = draft_layer(p, cfg, x, positions, attend)
    return rms_norm(x, dparams["norm"], cfg.rms_norm_eps)


def draft_block(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, cache: KVCache, anchor,
                *, depths: int | None = None, kernels: Kernels = Kernels()):
    """One forward of the block [anchor, MASK...] against the cached context.

    Returns draft logits [B, depths, V'] for depths 1..depths (float32; default all blk-1),
    over the draft vocabulary when the head has one (V' = its size; `vocab_ids` maps them to
    token ids). The tree of a small budget cannot use the deep slots, and their LM head (a
    [V', D] matmul per slot) is the costly part of the draft on a CPU."""
    b, blk = anchor.shape[0], dcfg.block_size
    depths = blk - 1 if depths is None else depths
    # A causal block's slot j sees slots <= j only, so the slots past the deepest drafted one
    # change nothing and are left out (the head's layers cost per slot); a bidirectional
    # block needs them all.
    n = depths + 1 if dcfg.causal else blk
    positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
    x = head_hidden(dparams, dcfg, cache, block_inputs(dparams, dcfg, tparams, anchor)[:, :n],
                    positions, block_mask(dcfg, b)[:, :n, :n], kernels=kernels)
    return draft_logits(dcfg, tparams, tcfg, x[:, 1:1 + depths], kernels)


def vocab_ids(dcfg: DraftConfig):
    """The token id of each column of the head's logits: [V'] int32, or None (all V)."""
    return None if dcfg.draft_vocab is None else jnp.asarray(dcfg.draft_vocab, jnp.int32)


def draft_logits(dcfg: DraftConfig, tparams, tcfg: ModelConfig, hidden,
                 kernels: Kernels = Kernels()):
    """Final-normed head states [..., T, D] -> float32 logits [..., T, V'] through the target's
    LM head, restricted to the draft vocabulary's rows when the head has one."""
    ids = vocab_ids(dcfg)
    if ids is None:
        return target.lm_head(tparams, tcfg, hidden, kernels)
    return target.lm_head_rows(tparams, tcfg, hidden, ids)
