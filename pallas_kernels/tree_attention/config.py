"""Tuning knobs of the tree/cache attention kernels (block sizes, warps, stages, splits).

`portable_config` / `mosaic_config` take a tuned entry from `tuned_<device>.json` in this
folder when one matches the shape (`common.tuned_config`; written by
bench/tune_attention.py), else a heuristic."""

import dataclasses
from pathlib import Path

from pallas_kernels import common

_HERE = Path(__file__).parent


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
    stages: K/V buffers in flight (shared memory about (64 + 2 * stages * block_k) * H * 2
    bytes: bf16 H=128 fits two CTAs per SM at block_k 64 / stages 2, whose softmax and wgmma
    then overlap); num_splits: split-K (None: auto, counting the CTAs that fit per SM).
    pv_via_smem: stage P through shared memory and accumulate P V in a fresh accumulator
    (the only form GPU interpret mode supports; always used there) instead of feeding P to
    wgmma from registers into the running accumulator."""

    block_k: int = 64
    stages: int = 4
    num_splits: int | None = None
    pv_via_smem: bool = False


def mosaic_smem_bytes(cfg: MosaicConfig, head_dim: int, rows: int = 64, itemsize: int = 2) -> int:
    """Shared memory of one Hopper-kernel CTA (Q/O tile, K/V stages, P staging, mask words)."""
    p_tile = rows * cfg.block_k if cfg.pv_via_smem else 8 * 64
    return (rows * head_dim + 2 * cfg.stages * cfg.block_k * head_dim + p_tile) * itemsize + 2048


def _tuned(cls, kernel, num_rows, head_dim, batch, num_queries, kv_len, dtype):
    """This device's tuned `cls` entry for the shape, or None (also when the shape is not
    fully known)."""
    if not num_queries:
        return None
    return common.tuned_config(common.tuned_path(_HERE), cls, kernel=kernel, batch=batch,
                               t=num_queries, group=num_rows // num_queries,
                               head_dim=head_dim, kv_len=kv_len, dtype=dtype)


def portable_config(num_rows: int, head_dim: int, *, batch: int = 1, num_queries: int | None = None,
                    kv_len: int | None = None, dtype=None) -> PortableConfig:
    """Config for rows = T * G packed queries: the tuned entry for the shape if there is one
    (needs num_queries, kv_len, dtype), else the heuristic."""
    tuned = _tuned(PortableConfig, "portable", num_rows, head_dim, batch, num_queries, kv_len,
                   dtype)
    if tuned is not None:
        return tuned
    if num_rows <= 16:
        return PortableConfig(block_q=16, block_k=128 if head_dim <= 128 else 64, num_warps=4,
                              num_stages=3)
    if num_rows <= 32:
        return PortableConfig(block_q=32, block_k=64, num_warps=4, num_stages=3)
    if head_dim > 128:
        return PortableConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
    if num_rows >= 512:
        # Many row blocks (big trees): 128-row tiles halve the K/V re-reads per row.
        return PortableConfig(block_q=128, block_k=64, num_warps=8, num_stages=3)
    return PortableConfig(block_q=64, block_k=64, num_warps=4, num_stages=3)


def mosaic_config(num_rows: int, head_dim: int, *, batch: int = 1, num_queries: int | None = None,
                  kv_len: int | None = None, dtype=None) -> MosaicConfig:
    """As `portable_config`, for the Hopper kernel."""
    tuned = _tuned(MosaicConfig, "hopper", num_rows, head_dim, batch, num_queries, kv_len, dtype)
    if tuned is not None:
        return tuned
    if head_dim <= 64:
        return MosaicConfig(block_k=128, stages=4)
    return MosaicConfig(block_k=64, stages=4)
