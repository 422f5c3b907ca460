"""Attention of T new queries against a KV cache: a fully visible prefix plus T block keys
under a T x T mask (tree ancestors, causal, or all-visible). Decode is the T=1 case.

Implementations: `reference` (XLA), `portable` (Pallas/Triton, any NVIDIA GPU), `hopper`
(Pallas Mosaic GPU, sm_90), and the split-K decode kernel in `pallas_kernels.decode_attention`;
`cache_attention(..., impl=...)` runs the first of a list that serves the call."""

from pallas_kernels.tree_attention.api import cache_attention, pack_block_mask

__all__ = ["cache_attention", "pack_block_mask"]
