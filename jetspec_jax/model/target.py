"""The Qwen3-family target model (Qwen3 dense, Qwen3-MoE, Llama) as pure functions.

`forward` takes tokens, their positions, the KV cache and an attention-mask description
(where the new keys are written and which of them each query sees), and returns final-normed
hidden states, the updated cache and, on request, the hidden states of chosen layers (taps).
Decoding, prefill, tree verification and training all go through it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jetspec_jax.model.cache import KVCache, Paging, write_slots
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.model.layers import XLA, moe, project, rms_norm, rope, swiglu
from jetspec_jax.model.layout import is_fused, split_qkv
from pallas_kernels import common, dispatch, paged
from pallas_kernels.decode_attention import fused_decode_attention, rope_cos_sin
from pallas_kernels.tree_attention import cache_attention

def embed(params, tokens):
    return params["embed"][tokens]  # [B, T, D]


def lm_head(params, cfg: ModelConfig, hidden, kernels: Kernels = XLA):
    """hidden [B, T, D] -> float32 logits [B, T, V]."""
    if cfg.tie_embeddings:  # contract with embed [V, D] as stored: XLA:CPU copied embed.T
        # on every one-row call, five times the matmul's own time (docs/experiments.md)
        return jnp.einsum("BTD,VD->BTV", hidden, params["embed"],
                          preferred_element_type=jnp.float32)
    return project("BTD,DV->BTV", hidden, params["lm_head"], kernels, jnp.float32)


def lm_head_rows(params, cfg: ModelConfig, hidden, ids):
    """hidden [..., D] -> float32 logits [..., len(ids)] of the vocabulary entries ids only."""
    rows = params["embed"][ids] if cfg.tie_embeddings else params["lm_head"][:, ids].T
    return jnp.einsum("...D,VD->...V", hidden, rows, preferred_element_type=jnp.float32)


def attention_block(p, cfg: ModelConfig, x, positions, k_cache, v_cache, write_start,
                    block_mask, kernels, fused: bool):
    """x [B, T, D] (already normed). Writes the new K/V at write_start and attends.
    fused: the layer's weights are in the fused layout (`layout.py`)."""
    if fused:  # one matmul for q, k and v
        q, k, v = split_qkv(project("BTD,DF->BTF", x, p["qkv"], kernels), cfg)
    else:
        q = project("BTD,DNH->BTNH", x, p["q"], kernels)
        k = project("BTD,DKH->BTKH", x, p["k"], kernels)
        v = project("BTD,DKH->BTKH", x, p["v"], kernels)
    out, k_cache, v_cache = attend(p, cfg, q, k, v, positions, k_cache, v_cache, write_start,
                                   block_mask, kernels)
    return project("BTNH,NHD->BTD", out, p["o"], kernels), k_cache, v_cache


def attend(p, cfg: ModelConfig, q, k, v, positions, k_cache, v_cache, write_start,
           block_mask, kernels):
    """The projections q [B, T, N, H], k, v [B, T, KV, H] -> (attention output [B, T, N, H],
    caches with the new K/V written): q/k norms, RoPE, cache write and cache attention, by
    the first of `kernels.attention` that serves the call (`pallas_kernels.dispatch`)."""
    impls = {n: functools.partial(_attend, impl=n) for n in kernels.cache_attention()}
    impls["fused_decode"] = _fused_decode
    return dispatch.run("attention", kernels.attention, impls, p, cfg, q, k, v, positions,
                        k_cache, v_cache, write_start, block_mask, interpret=kernels.interpret)


def _attend(p, cfg: ModelConfig, q, k, v, positions, k_cache, v_cache, write_start,
            block_mask, *, impl: str, interpret: bool):
    """The unfused step, its cache attention by `impl`."""
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    k_cache = write_slots(k_cache, k, write_start)
    v_cache = write_slots(v_cache, v, write_start)
    return cache_attention(q, k_cache, v_cache, write_start, block_mask, impl=impl,
                           interpret=interpret), k_cache, v_cache


def _fused_decode(p, cfg: ModelConfig, q, k, v, positions, k_cache, v_cache, write_start,
                  block_mask, *, interpret: bool):
    """(out, k_cache, v_cache) from the fused decode kernel; it declines
    (NotImplementedError) more than one token, a cache dtype other than the activations',
    ..."""
    del block_mask  # one token sees its own key, which the contract makes visible
    if q.shape[1] != 1:
        raise NotImplementedError(f"the fused decode kernel takes one token, got {q.shape[1]}")
    common.require_gpu("fused decode kernel", interpret)
    paged.refuse(k_cache, "fused decode kernel")
    cos, sin = rope_cos_sin(positions[:, 0], cfg.head_dim, cfg.rope_theta)
    norms = (p["q_norm"], p["k_norm"]) if cfg.qk_norm else (None, None)
    return fused_decode_attention(q, k, v, k_cache, v_cache, write_start, cos, sin, *norms,
                                  eps=cfg.rms_norm_eps, interpret=interpret)


def mlp_block(p, cfg: ModelConfig, x, kernels: Kernels = XLA, fused: bool = False):
    """fused: a dense MLP's weights in the fused layout (MoE experts are never fused)."""
    if "router" in p:
        return moe(x, p["router"], p["gate"], p["up"], p["down"],
                   top_k=cfg.experts_per_token, normalize=cfg.norm_topk_prob,
                   kernels=kernels)
    if fused:  # one matmul for gate and up
        gate, up = jnp.split(project("BTD,DF->BTF", x, p["gate_up"], kernels), 2, axis=-1)
        return project("BTF,FD->BTD", jax.nn.silu(gate) * up, p["down"], kernels)
    return swiglu(x, p["gate"], p["up"], p["down"], kernels)


def decoder_layer(p, cfg: ModelConfig, x, positions, k_cache, v_cache, write_start, block_mask,
                  kernels: Kernels, fused: bool = False):
    """One layer over the residual stream x [B, T, D] -> (x, k_cache, v_cache)."""
    eps = cfg.rms_norm_eps
    h, k_cache, v_cache = attention_block(p, cfg, rms_norm(x, p["attn_norm"], eps), positions,
                                          k_cache, v_cache, write_start, block_mask, kernels,
                                          fused)
    x = x + h
    return x + mlp_block(p, cfg, rms_norm(x, p["mlp_norm"], eps), kernels, fused), \
        k_cache, v_cache


def forward(params, cfg: ModelConfig, tokens, positions, cache: KVCache, write_start,
            block_mask=None, *, taps: tuple[int, ...] = (), kernels: Kernels = XLA):
    """Runs the target over T new tokens per sequence.

    tokens, positions [B, T]; write_start [B]: the new tokens' K/V go to slots
    write_start[b] + t and each query sees every slot below write_start[b] plus the new
    keys allowed by block_mask [B, T, T] (None: causal).
    Returns (hidden [B, T, D] after the final norm, cache with the new K/V written
    (lengths unchanged), taps [B, T, len(taps) * D] of the outputs of layers `taps`, or None).
    """
    x = embed(params, tokens)
    new_k, new_v, tapped = [], [], {}
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            x, kc, vc = decoder_layer(p, cfg, x, positions, *cache.layer(i), write_start,
                                      block_mask, kernels, is_fused(params))
        new_k.append(kc)
        new_v.append(vc)
        if i in taps:
            tapped[i] = x
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    tap_out = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    return hidden, cache.with_layers(new_k, new_v), tap_out


def allocate_cache(cfg: ModelConfig, batch: int, num_slots: int, dtype,
                   paging: Paging | None = None, table=None) -> KVCache:
    """Dense, or paged with paging and table [batch, num_slots / block_size]."""
    return KVCache.allocate(cfg.num_layers, batch, cfg.num_kv_heads, num_slots, cfg.head_dim,
                            dtype, paging, table)
