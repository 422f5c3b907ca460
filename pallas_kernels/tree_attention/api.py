"""Cache attention of T queries by implementation name:

  "decode"     the split-K decode kernel (`pallas_kernels.decode_attention`; T == 1 only).
  "hopper"     Pallas Mosaic GPU (wgmma + TMA), sm_90 only.
  "portable"   Pallas, Triton lowering, any NVIDIA GPU.
  "reference"  the pure-JAX reference (XLA); serves every call.

impl: a name or an ordered list of names (`pallas_kernels.dispatch`: an implementation that
cannot serve the call raises NotImplementedError and the next one serves); None: `DEFAULT`,
the fastest first. The Pallas kernels serve off a GPU only in interpret mode (CPU testing).
"""

from __future__ import annotations

from collections.abc import Sequence

from pallas_kernels import common, dispatch, paged
from pallas_kernels.tree_attention import mask as mask_lib
from pallas_kernels.tree_attention.reference import cache_attention_reference

DEFAULT = ("decode", "hopper", "portable", "reference")


def _reference(q, k_cache, v_cache, prefix_len, block_mask, *, interpret, config):
    del interpret, config
    return cache_attention_reference(q, k_cache, v_cache, prefix_len,
                                     mask_lib.as_dense(block_mask, q.shape[1]))


def _portable(q, k_cache, v_cache, prefix_len, block_mask, *, interpret, config):
    from pallas_kernels.tree_attention.portable import cache_attention_portable

    common.require_gpu("portable tree-attention kernel", interpret)
    return cache_attention_portable(q, k_cache, v_cache, prefix_len, block_mask, config=config,
                                    interpret=interpret)


def _hopper(q, k_cache, v_cache, prefix_len, block_mask, *, interpret, config):
    from pallas_kernels.tree_attention.hopper import cache_attention_hopper

    common.require_gpu("Hopper tree-attention kernel", interpret, hopper=True)
    paged.refuse(k_cache, "Hopper tree-attention kernel")
    return cache_attention_hopper(q, k_cache, v_cache, prefix_len, block_mask, config=config,
                                  interpret=interpret)


def _decode(q, k_cache, v_cache, prefix_len, block_mask, *, interpret, config):
    from pallas_kernels.decode_attention import decode_attention

    # T == 1: the only block key is the query's own, which the contract makes visible.
    return decode_attention(q, k_cache, v_cache, prefix_len, impl="splitk", config=config,
                            interpret=interpret)


IMPLEMENTATIONS = {"decode": _decode, "hopper": _hopper, "portable": _portable,
                   "reference": _reference}


def cache_attention(q, k_cache, v_cache, prefix_len, block_mask=None, *,
                    impl: str | Sequence[str] | None = None, interpret: bool = False,
                    config=None):
    """See `reference.cache_attention_reference` for the contract (paged caches: the reference
    only). block_mask: None (causal), bool [B, T, T], or bit-packed uint32 [B, T, ceil(T/32)]
    (`mask.pack_block_mask`). config: a kernel config (for a list naming one kernel)."""
    return dispatch.run("cache attention", DEFAULT if impl is None else impl, IMPLEMENTATIONS,
                        q, k_cache, v_cache, prefix_len, block_mask, interpret=interpret,
                        config=config)


def pack_block_mask(block_mask):
    """bool [B, T, T] -> uint32 [B, T, ceil(T/32)] (what the kernels read)."""
    return mask_lib.pack_block_mask(block_mask)


__all__ = ["cache_attention", "pack_block_mask", "IMPLEMENTATIONS", "DEFAULT"]
