"""Decode attention (T = 1 query per sequence) against a KV cache, split-K over the cache, with
its pure-JAX reference (`api.decode_attention` picks by name); and its fused form that also
applies the q/k norms and RoPE and writes the new token's K/V."""

from pallas_kernels.decode_attention.api import decode_attention
from pallas_kernels.decode_attention.fused import fused_decode_attention, rope_cos_sin

__all__ = ["decode_attention", "fused_decode_attention", "rope_cos_sin"]
