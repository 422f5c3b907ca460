"""Picks an implementation of cache attention for the device; falls back to the reference.

impl:
  "auto"       GPU: T == 1 -> split-K decode kernel; compute capability 9.x and a supported
               shape -> Hopper Mosaic GPU kernel; else the portable (Triton-lowered) kernel;
               each falls back to the next on NotImplementedError, finally to the XLA
               reference. CPU: reference (unless interpret=True: the GPU chain in interpret
               mode).
  "reference"  pure-JAX reference (XLA).
  "portable"   Pallas, Triton lowering, any NVIDIA GPU.
  "hopper"     Pallas Mosaic GPU (wgmma + TMA), sm_90 only.
  "decode"     split-K decode kernel (T == 1 only).
Forced kernels raise NotImplementedError for shapes they cannot serve.
interpret=True runs the Pallas kernels in interpret mode (CPU testing).
"""

from __future__ import annotations

from pallas_kernels import common
from pallas_kernels.tree_attention import mask as mask_lib
from pallas_kernels.tree_attention.reference import cache_attention_reference


def _reference(q, k_cache, v_cache, prefix_len, block_mask, *, interpret=False, config=None):
    del interpret, config
    return cache_attention_reference(q, k_cache, v_cache, prefix_len,
                                     mask_lib.as_dense(block_mask, q.shape[1]))


def _portable(q, k_cache, v_cache, prefix_len, block_mask, *, interpret=False, config=None):
    from pallas_kernels.tree_attention.portable import cache_attention_portable

    return cache_attention_portable(q, k_cache, v_cache, prefix_len, block_mask, config=config,
                                    interpret=interpret)


def _hopper(q, k_cache, v_cache, prefix_len, block_mask, *, interpret=False, config=None):
    from pallas_kernels.tree_attention.hopper import cache_attention_hopper

    return cache_attention_hopper(q, k_cache, v_cache, prefix_len, block_mask, config=config,
                                  interpret=interpret)


def _decode(q, k_cache, v_cache, prefix_len, block_mask, *, interpret=False, config=None):
    from pallas_kernels.decode_attention import decode_attention

    # T == 1: the only block key is the query's own, which the contract makes visible.
    return decode_attention(q, k_cache, v_cache, prefix_len, config=config, interpret=interpret)


IMPLEMENTATIONS = {
    "reference": _reference,
    "portable": _portable,
    "hopper": _hopper,
    "decode": _decode,
}


def _is_hopper() -> bool:
    platform, cc, _ = common.device_info()
    return platform == "gpu" and cc is not None and str(cc).startswith("9")


def auto_chain(num_queries: int, *, interpret: bool = False) -> list[str]:
    """Implementations "auto" tries, in order."""
    on_gpu = common.device_info()[0] == "gpu"
    if not (on_gpu or interpret):
        return ["reference"]
    chain = []
    if num_queries == 1:
        chain.append("decode")
    if interpret or _is_hopper():
        chain.append("hopper")
    chain += ["portable", "reference"]
    return chain


def cache_attention(q, k_cache, v_cache, prefix_len, block_mask=None, *, impl="auto",
                    interpret: bool = False, config=None):
    """See `reference.cache_attention_reference` for the contract. block_mask: None (causal),
    bool [B, T, T], or bit-packed uint32 [B, T, ceil(T/32)] (`mask.pack_block_mask`).
    config: a kernel config (only with a forced impl)."""
    if impl == "auto":
        errors = []
        for name in auto_chain(q.shape[1], interpret=interpret):
            try:
                return IMPLEMENTATIONS[name](q, k_cache, v_cache, prefix_len, block_mask,
                                             interpret=interpret and name != "reference")
            except NotImplementedError as e:  # shape not served: next candidate
                errors.append(f"{name}: {e}")
        raise NotImplementedError("; ".join(errors))
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(
            f"unknown attention impl {impl!r}; choose from {sorted(IMPLEMENTATIONS) + ['auto']}"
        ) from None
    return fn(q, k_cache, v_cache, prefix_len, block_mask, interpret=interpret, config=config)


def pack_block_mask(block_mask):
    """bool [B, T, T] -> uint32 [B, T, ceil(T/32)] (what the kernels read)."""
    return mask_lib.pack_block_mask(block_mask)


__all__ = ["cache_attention", "pack_block_mask", "IMPLEMENTATIONS", "auto_chain"]
