"""Decode attention (T = 1 query per sequence) against a KV cache, split-K over the cache."""

from pallas_kernels.decode_attention.kernel import decode_attention

__all__ = ["decode_attention"]
