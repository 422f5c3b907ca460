"""Tuning knobs of the tree/cache attention kernels (block sizes, warps, stages, splits)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class PortableConfig:
    """Triton-lowered kernel. Rows = T * G packed queries per KV head.

    block_q: rows per program (power of two, >= 16).
    block_k: prefix KV slots per inner step (power of two, >= 16).
    block_kb: block-key slots per inner step over the T new keys (multiple of 32).
    num_splits: split-K factor over the prefix (None: automatic from grid size vs SMs).
    """

    block_q: int = 64
    block_k: int = 64
    block_kb: int = 32
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Hopper (sm_90) kernel: one warpgroup computes 64 rows with wgmma; TMA fetches K/V.

    block_k: KV slots per step (multiple of 64; the cache length must be a multiple of it);
    stages: K/V buffers in flight; num_splits: split-K (None: auto).
    pv_via_smem: stage P through shared memory and accumulate P V in a fresh accumulator
    (the only form GPU interpret mode supports; always used there) instead of feeding P to
    wgmma from registers into the running accumulator."""

    block_k: int = 64
    stages: int = 4
    num_splits: int | None = None
    pv_via_smem: bool = False


def portable_config(num_rows: int, head_dim: int) -> PortableConfig:
    """Default portable config for rows = T * G packed queries."""
    if num_rows <= 16:
        return PortableConfig(block_q=16, block_k=128 if head_dim <= 128 else 64, num_warps=4,
                              num_stages=3)
    if num_rows <= 32:
        return PortableConfig(block_q=32, block_k=64, num_warps=4, num_stages=3)
    if head_dim > 128:
        return PortableConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
    return PortableConfig(block_q=64, block_k=64, num_warps=4, num_stages=3)


def mosaic_config(num_rows: int, head_dim: int) -> MosaicConfig:
    if head_dim <= 64:
        return MosaicConfig(block_k=128, stages=4)
    return MosaicConfig(block_k=64, stages=4)
