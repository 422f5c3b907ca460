"""Pure-JAX reference of decode attention (T = 1): the query sees cache slots [0, prefix_len],
its own key at prefix_len. Also a selectable implementation (XLA)."""

import jax.numpy as jnp

from pallas_kernels.paged import logical
from pallas_kernels.tree_attention.reference import masked_attention


def decode_attention_reference(q, k_cache, v_cache, prefix_len):
    """q [B, 1, N, H]; k_cache, v_cache [B, K, S, H] or `paged.Pages`; prefix_len [B] ->
    [B, 1, N, H] in q.dtype, softmax in float32."""
    if q.shape[1] != 1:
        raise NotImplementedError(f"decode attention needs T == 1, got T={q.shape[1]}")
    k_cache, v_cache = logical(k_cache), logical(v_cache)
    slots = jnp.arange(k_cache.shape[2])
    visible = slots[None, None, :] <= prefix_len[:, None, None]  # [B, 1, S]
    return masked_attention(q, k_cache, v_cache, visible)
