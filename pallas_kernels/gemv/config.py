"""Tuning knobs of the small-M weight-streaming matmuls, heuristics from the shapes, and the
per-device table of shapes where the kernel beat XLA (`tuned_<device>.json` in this folder,
written by bench/bench_gemv_pallas.py --write-table)."""

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from pallas_kernels import common

_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """block_k x block_n: the weight tile one loop step loads (powers of two, >= 16).
    num_splits: split-K factor (None: automatic). use_dot: multiply on tensor cores with the
    rows padded to 16; else broadcast-multiply into a [rows, block_k, block_n] float32
    accumulator reduced once at the end (for 1-4 rows; Triton does not pipeline these loads).
    The grouped (MoE) kernel has one row per pair: the dot form pads it with 15 zero rows,
    the other accumulates [block_k, block_n]. The same knobs serve both kernels.
    evict_first: hint that weight lines are read once (kept by plain loads; the pipelined
    cp.async loads of the dot form drop it)."""

    block_k: int = 128
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    use_dot: bool = True
    evict_first: bool = True


def gemv_config(m: int, k: int, n: int, *, sms: int | None = None) -> GemvConfig:
    """Default config: 64-wide column strips for narrow outputs (k/v projections) so that
    there are enough strips, 128 otherwise; the split count from `auto_num_splits`."""
    block_n = 64 if n <= 2048 else 128
    block_n = min(block_n, max(16, common.next_pow2(n)))
    block_k = min(128, max(16, common.next_pow2(k)))
    return GemvConfig(block_k=block_k, block_n=block_n,
                      num_splits=auto_num_splits(m, k, n, block_k, block_n, sms=sms))


def grouped_config(p: int, k: int, n: int, *, sms: int | None = None) -> GemvConfig:
    """Default config of the grouped kernel (one weight row per pair, so the rows of the dot
    are padded from 1): blocks as `gemv_config`, splits counting every pair's strips."""
    base = gemv_config(1, k, n, sms=sms)
    return dataclasses.replace(base, num_splits=auto_num_splits(
        1, k, n, base.block_k, base.block_n, sms=sms, groups=p))


@dataclasses.dataclass(frozen=True)
class SortedConfig(GemvConfig):
    """Config of the expert-major kernel (`expert_major.py`; `use_dot` is ignored: it always
    multiplies on tensor cores). row_blocks: 16-row blocks of one expert's rows multiplied by
    each weight tile while it is loaded (one float32 [16, block_n] accumulator each); an
    expert with more than 16 * row_blocks rows streams its weights once per such pass."""

    row_blocks: int = 4


def sorted_config(p: int, e: int, k: int, n: int, *, sms: int | None = None) -> SortedConfig:
    """Default config of the expert-major kernel for P rows over E experts: blocks as
    `gemv_config`; splits counting the strips of the (at most min(P, E)) touched experts, the
    float32 partials capped at the average rows per touched expert."""
    base = gemv_config(1, k, n, sms=sms)
    groups = max(1, min(p, e))
    splits = auto_num_splits(common.cdiv(p, groups), k, n, base.block_k, base.block_n,
                             sms=sms, groups=groups)
    return SortedConfig(block_k=base.block_k, block_n=base.block_n, num_splits=splits)


def auto_num_splits(m: int, k: int, n: int, block_k: int, block_n: int, *,
                    sms: int | None = None, programs_per_sm: int = 4, groups: int = 1) -> int:
    """Split-K factor: enough programs for `programs_per_sm` per SM, each split at least two
    K blocks, and the float32 partials (written and read back: 8 * splits * M * N bytes) at
    most 1/16 of the weight bytes. Rounded to a divisor of the K block count so that splits
    are even. groups: independent [K, N] weights multiplied side by side (grouped kernel)."""
    sms = common.num_sms() if sms is None else sms
    strips = groups * common.cdiv(n, block_n)
    k_blocks = common.cdiv(k, block_k)
    want = common.cdiv(programs_per_sm * sms, strips)
    cap = max(1, min(k_blocks // 2, k // (64 * m)))
    divisors = [d for d in range(1, k_blocks + 1) if k_blocks % d == 0 and d <= cap]
    above = [d for d in divisors if d >= want]
    return above[0] if above else divisors[-1]


def tuned_gemv_config(m: int, k: int, n: int, dtype, *, path=None) -> GemvConfig | None:
    """The table's config for x [M, K] @ w [K, N] of `dtype` on this device, or None (no table
    for the device, or no entry: the kernel did not beat XLA there). An entry serves a call
    when K, N and dtype are equal and M rounds up to the same power of two (M=1 is its own
    bucket; 3 and 4 share one). path: the table (None: `tuned_<device tag>.json` here)."""
    path = common.tuned_path(_HERE) if path is None else Path(path)
    if path is None or not path.is_file():
        return None
    want = ("gemv", k, n, common.next_pow2(m), str(jnp.dtype(dtype)))
    for e in common.load_tuned(str(path)):
        try:
            if (e["kernel"], e["K"], e["N"], common.next_pow2(e["M"]), e["dtype"]) == want:
                return GemvConfig(**e["config"])
        except (KeyError, TypeError, ValueError):
            continue
    return None
