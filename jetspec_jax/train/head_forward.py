"""The draft head's training forward: many anchored blocks per sequence in one pass.

At inference a block anchored at position a (the last committed token, whose taps are not yet
in the context) sees the context features of positions 0..a-1 and sits at positions
a..a+blk-1. Here the frozen target runs once over whole sequences [B, T]; the context K/V of
every position is built once per layer (with `draft_head.extend_context`, so it is the
inference code) and A blocks per sequence attend to it under a dense mask: block slots of
anchor a see context positions < a and the slots of their own block (causal or bidirectional
as `dcfg.causal`), never another block. Plain jnp (or, on a GPU, cuDNN's fused attention),
for training and tests; the inference path keeps the cached kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.draft import head as draft_head
from jetspec_jax.draft.head import DraftConfig, dense_attention
from jetspec_jax.model import target
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.model.layers import XLA, rms_norm


def target_pass(tparams, tcfg: ModelConfig, tokens, tap_layers, kernels: Kernels = XLA):
    """Causal target forward over tokens [B, T] -> (final hidden [B, T, D], taps [B, T, k*D]).
    kernels: its attention and matmuls (`kernels.choose`); forward only, never differentiated
    (the GPU kernels have no gradient)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = target.allocate_cache(tcfg, b, t, tparams["embed"].dtype)
    hidden, _, taps = target.forward(tparams, tcfg, tokens, positions, cache,
                                     jnp.zeros((b,), jnp.int32), taps=tap_layers,
                                     kernels=kernels)
    return hidden, taps


def sample_anchors(key, lengths, prompt_lengths, num_anchors: int, seq_len: int):
    """A distinct random anchors per sequence in the response region [P, L-2] (an anchor needs
    at least one supervised token after it). -> (anchors [B, A] int32, valid [B, A]); when a
    sequence has fewer than A such positions the rest are marked invalid."""
    pos = jnp.arange(seq_len)[None, :]
    ok = (pos >= prompt_lengths[:, None]) & (pos <= lengths[:, None] - 2)  # [B, T]
    score = jnp.where(ok, jax.random.uniform(key, ok.shape), -1.0)
    top, anchors = jax.lax.top_k(score, num_anchors)
    return anchors.astype(jnp.int32), top >= 0


def block_visibility(dcfg: DraftConfig, anchors, seq_len: int):
    """anchors [B, A] -> bool [B, A*blk, T + A*blk]: context positions < anchor, then the
    block slots of the query's own block (lower-triangular when causal)."""
    b, a = anchors.shape
    blk = dcfg.block_size
    ctx = jnp.arange(seq_len)[None, None, None, :] < anchors[:, :, None, None]  # [B, A, 1, T]
    ctx = jnp.broadcast_to(ctx, (b, a, blk, seq_len)).reshape(b, a * blk, seq_len)
    inside = draft_head.block_mask(dcfg, 1)[0]  # [blk, blk]
    own = jnp.eye(a, dtype=bool)[:, None, :, None] & inside[None, :, None, :]  # [A, blk, A, blk]
    own = jnp.broadcast_to(own.reshape(1, a * blk, a * blk), (b, a * blk, a * blk))
    return jnp.concatenate([ctx, own], axis=-1)


def head_context(dparams, dcfg: DraftConfig, taps):
    """Context K/V of all T positions of taps [B, T, k*D] for every draft layer (a KVCache
    filled by `draft_head.extend_context`, so it is the inference code)."""
    b, t = taps.shape[:2]
    return draft_head.extend_context(
        dparams, dcfg, draft_head.allocate_cache(dcfg, b, t, dparams["fc"].dtype), taps,
        jnp.full((b,), t, jnp.int32))


def fused_attention(q, k, v, visible, implementation: str = "cudnn"):
    """`dense_attention`'s result from one fused kernel (cuDNN's flash attention on a GPU: no
    [queries x keys] scores written, forward or backward) over bfloat16 q, k, v, returned in
    q.dtype. implementation "xla" is the same call through XLA (the CPU tests' check of the
    layout and the mask)."""
    bf16 = jnp.bfloat16
    out = jax.nn.dot_product_attention(q.astype(bf16), k.astype(bf16), v.astype(bf16),
                                       mask=visible[:, None], implementation=implementation)
    return out.astype(q.dtype)


def head_logits(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, taps, tokens, anchors,
                *, ctx=None, attention: str = "reference"):
    """Draft logits [B, A, blk-1, V'] (float32; V' the draft vocabulary's size, if the head
    has one) of the blocks anchored at anchors [B, A].

    taps [B, T, k*D] are the target's tapped features of tokens [B, T]; slot d of the block
    at anchor a drafts the token at position a + d, exactly as `draft_block` would after
    `extend_context` with the taps of positions 0..a-1. ctx: `head_context(taps)`, when
    already made (chunks of anchors share it). attention: the blocks' attention, "reference"
    (`dense_attention`, float32 softmax) or "cudnn" (`fused_attention`, a GPU's)."""
    cfg = dcfg.layers
    b, t = tokens.shape
    a = anchors.shape[1]
    blk = dcfg.block_size
    ctx = head_context(dparams, dcfg, taps) if ctx is None else ctx
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
    x = draft_head.block_inputs(dparams, dcfg, tparams, anchor_tok.reshape(b * a))
    x = x.reshape(b, a * blk, -1)  # [B, A*blk, D]
    positions = (anchors[:, :, None] + jnp.arange(blk, dtype=jnp.int32)).reshape(b, a * blk)
    visible = block_visibility(dcfg, anchors, t)
    for p, kc, vc in zip(dparams["layers"], ctx.k, ctx.v):
        def attend(q, k, v, kc=kc, vc=vc):  # the block's own K/V after the context's
            k = jnp.concatenate([kc.transpose(0, 2, 1, 3).astype(k.dtype), k], axis=1)
            v = jnp.concatenate([vc.transpose(0, 2, 1, 3).astype(v.dtype), v], axis=1)
            if attention == "cudnn":
                return fused_attention(q, k, v, visible), None
            return dense_attention(q, k, v, visible), None

        x, _ = draft_head.draft_layer(p, cfg, x, positions, attend)
    x = rms_norm(x, dparams["norm"], cfg.rms_norm_eps).reshape(b, a, blk, -1)
    slots = x[:, :, 1:].reshape(b, a * (blk - 1), -1)
    return draft_head.draft_logits(dcfg, tparams, tcfg, slots).reshape(b, a, blk - 1, -1)
