"""Pure-JAX reference of cache attention; also a selectable implementation (XLA)."""

import jax
import jax.numpy as jnp

from pallas_kernels.paged import logical


def visibility(prefix_len, block_mask, num_queries, num_slots):
    """Dense [B, T, S] visibility: slots < prefix_len, plus block slot prefix_len + j where
    block_mask[b, t, j] (block_mask None means causal)."""
    slots = jnp.arange(num_slots)[None, None, :]  # [1, 1, S]
    rel = slots - prefix_len[:, None, None]  # [B, 1, S] block-relative slot index
    in_prefix = rel < 0
    in_block = (rel >= 0) & (rel < num_queries)
    t = jnp.arange(num_queries)[None, :, None]  # [1, T, 1]
    if block_mask is None:
        block_visible = rel <= t
    else:
        idx = jnp.clip(rel, 0, num_queries - 1)  # [B, 1, S]
        idx = jnp.broadcast_to(idx, (prefix_len.shape[0], num_queries, num_slots))
        block_visible = jnp.take_along_axis(block_mask, idx, axis=2)
    return in_prefix | (in_block & block_visible)


def _cpu_safe(x):
    """XLA:CPU's dot thunk rejects bf16 x bf16 -> f32 (batched); there, compute the dot on
    float32 copies instead: products of 16-bit floats are exact in float32, so the result is
    the same. Other backends keep the 16-bit operands."""
    if jax.default_backend() == "cpu" and x.dtype in (jnp.bfloat16, jnp.float16):
        return x.astype(jnp.float32)
    return x


def cache_attention_reference(q, k_cache, v_cache, prefix_len, block_mask=None):
    """q [B, T, N, H]; k_cache, v_cache [B, K, S, H] or `paged.Pages` (read as their logical
    view); prefix_len [B]; block_mask [B, T, T] bool or None (causal). The block's own keys
    must already sit at slots prefix_len + j. Returns [B, T, N, H] in q.dtype; softmax in
    float32."""
    k_cache, v_cache = logical(k_cache), logical(v_cache)
    visible = visibility(prefix_len, block_mask, q.shape[1], k_cache.shape[2])
    return masked_attention(q, k_cache, v_cache, visible)


def masked_attention(q, k, v, visible):
    """q [B, T, N, H]; k, v [B, K, S, H]; visible [B, T, S] bool -> [B, T, N, H] in q.dtype,
    softmax in float32: attention under any dense visibility (GQA: query head n reads KV head
    n // (N / K))."""
    b, t, n, h = q.shape
    k_heads = k.shape[1]
    g = n // k_heads
    qg = q.reshape(b, t, k_heads, g, h)  # [B, T, K, G, H]
    if t == 1:  # k first: q first, XLA:CPU copies the whole KV cache at every decode step;
        #          a tree's T > 1 queries ran faster q first
        logits = jnp.einsum("BKSH,BTKGH->BKGTS", _cpu_safe(k), _cpu_safe(qg),
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("BTKGH,BKSH->BKGTS", _cpu_safe(qg), _cpu_safe(k),
                            preferred_element_type=jnp.float32)
    logits = logits * (h**-0.5)
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)  # [B, K, G, T, S]
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("BKGTS,BKSH->BTKGH", _cpu_safe(probs.astype(v.dtype)), _cpu_safe(v),
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)
