"""Helpers shared by the attention kernels: GQA row packing, split-K combination, device info."""

import functools
import json
import math
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
# Running-max start value: finite, so fully masked rows give exp2(-inf - NEG) = 0 and never NaN.
NEG_INIT = -1e30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def pack_rows(q, num_kv_heads: int, padded_rows: int, padded_head_dim: int | None = None):
    """q [B, T, N, H] -> [B, K, Rp, Hp]: the G = N / K query heads sharing a KV head and the T
    queries become rows r = t * G + g (zero-padded to Rp rows, and to Hp head dims)."""
    b, t, n, h = q.shape
    g = n // num_kv_heads
    x = q.reshape(b, t, num_kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * g, h)
    hp = h if padded_head_dim is None else padded_head_dim
    if padded_rows != t * g or hp != h:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, padded_rows - t * g), (0, hp - h)))
    return x


def unpack_rows(o, num_queries: int, num_q_heads: int, head_dim: int):
    """[B, K, Rp, Hp] -> [B, T, N, H] (inverse of `pack_rows`)."""
    b, k = o.shape[:2]
    g = num_q_heads // k
    o = o[:, :, : num_queries * g, :head_dim].reshape(b, k, num_queries, g, head_dim)
    return o.transpose(0, 2, 1, 3, 4).reshape(b, num_queries, num_q_heads, head_dim)


def combine_splits(o_parts, lse_parts, split_axis: int):
    """Merges split-K partial results. o_parts: per-split normalized outputs (float32);
    lse_parts: per-split log2-sum-exp2 of the scaled logits (-inf where a split saw nothing),
    same shape as o_parts without the last axis. Returns float32 with split_axis removed."""
    m = jnp.max(lse_parts, axis=split_axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp2(lse_parts - m)  # 0 for empty splits
    denom = jnp.sum(w, axis=split_axis)
    num = jnp.sum(o_parts.astype(jnp.float32) * w[..., None], axis=split_axis)
    denom = jnp.where(denom > 0, denom, 1.0)
    return num / denom[..., None]


@functools.cache
def device_info():
    """(platform, compute capability string or None, number of SMs) of the default device."""
    try:
        d = jax.devices()[0]
    except Exception:  # pragma: no cover
        return ("cpu", None, 132)
    cc = getattr(d, "compute_capability", None)
    sms = getattr(d, "core_count", None) or 132
    return (d.platform, cc, int(sms))


def require_gpu(what: str, interpret: bool, *, hopper: bool = False) -> None:
    """Raises NotImplementedError (the next implementation serves) unless this device runs
    the Pallas kernel `what`: a GPU (sm_90 with hopper), or any device in interpret mode."""
    if interpret:
        return
    platform, cc, _ = device_info()
    if platform != "gpu":
        raise NotImplementedError(f"{what} needs a GPU (or interpret mode), not {platform}")
    if hopper and not str(cc).startswith("9"):
        raise NotImplementedError(f"{what} needs compute capability 9.x, got {cc}")


def num_sms() -> int:
    return device_info()[2]


SMEM_PER_SM = 228 * 1024  # shared memory per SM on sm_90; each CTA also reserves 1 KiB


def ctas_per_sm(smem_bytes: int) -> int:
    """CTAs that fit on one SM by shared memory (1 to 4)."""
    return max(1, min(4, SMEM_PER_SM // (smem_bytes + 1024)))


def auto_num_splits(programs: int, kv_len: int, block_k: int, *, sms: int | None = None,
                    ctas: int = 1, min_blocks_per_split: int = 2, max_splits: int = 64) -> int:
    """Split-K factor so that programs * splits covers the GPU's resident CTA slots (sms *
    ctas per SM) about twice, while each split still gets at least `min_blocks_per_split` KV
    blocks of the (static) cache length."""
    sms = (num_sms() if sms is None else sms) * max(1, ctas)
    if programs >= sms:
        return 1
    want = cdiv(2 * sms, programs)
    cap = max(1, kv_len // (block_k * min_blocks_per_split))
    return int(max(1, min(want, cap, max_splits)))


@functools.cache
def device_tag() -> str | None:
    """Short name of the default GPU for tuned-config files ("NVIDIA H200" -> "h200"); None
    off-GPU."""
    try:
        d = jax.devices()[0]
    except Exception:  # pragma: no cover
        return None
    if d.platform != "gpu":
        return None
    kind = re.sub(r"[^a-z0-9]+", "_", str(getattr(d, "device_kind", "")).lower()).strip("_")
    return kind.removeprefix("nvidia_") or None


def tuned_path(op_dir: str | os.PathLike) -> Path | None:
    """`<op_dir>/tuned_<device tag>.json` (written by bench/tune_attention.py), or None."""
    tag = device_tag()
    return None if tag is None else Path(op_dir) / f"tuned_{tag}.json"


@functools.cache
def load_tuned(path: str) -> tuple:
    """The entries of a tuned-config table (empty if unreadable), read once per path."""
    try:
        return tuple(json.loads(Path(path).read_text()).get("entries", ()))
    except (OSError, ValueError, AttributeError):
        return ()


def tuned_config(path, cls, *, kernel: str, batch: int, t: int, group: int, head_dim: int,
                 kv_len: int | None, dtype):
    """The tuned `cls` config for a shape from the JSON table at `path`, or None (also when
    kv_len or dtype is unknown: callers that do not pass the shape get their heuristic).

    An entry serves a call when kernel, dtype, group G and head dim H are equal and batch and
    T round up to the same power of two; among those, the one with the nearest cache length S
    within a factor of 2 wins (S is tuned at a few lengths). Entries whose config does not
    build (unknown field) are skipped."""
    if path is None or not kv_len or dtype is None or not Path(path).is_file():
        return None
    want = dict(kernel=kernel, G=group, H=head_dim, dtype=str(jnp.dtype(dtype)),
                batch=next_pow2(batch), T=next_pow2(t))
    best, best_dist = None, 1.0
    for e in load_tuned(str(path)):
        try:
            key = dict(kernel=e["kernel"], G=e["G"], H=e["H"], dtype=e["dtype"],
                       batch=next_pow2(e["batch"]), T=next_pow2(e["T"]))
            dist = abs(math.log2(e["S"] / kv_len))
            if key != want or dist > best_dist:
                continue
            cfg = cls(**e["config"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            continue
        best, best_dist = cfg, dist
    return best


def kernel_dot(a, b, *, trans_b: bool = False, precision=None, upcast: bool = False):
    """Dot with float32 accumulation inside a Triton-lowered kernel. upcast=True (interpret
    mode on CPU, whose dot thunk lacks bf16 x bf16 -> f32) computes in float32 instead: the
    products of bf16/f16 inputs are exact in float32, so results match the GPU's."""
    from jax.experimental.pallas import triton as pltr

    if upcast and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        precision = jax.lax.Precision.HIGHEST
    return pltr.dot(a, b, trans_b=trans_b, precision=precision)


def load_rows(ref, start, size, width, head_ok, row_ok, col: int = 0, lead: tuple = ()):
    """Loads ref[*lead, start:start+size, col:col+width] in a Triton-lowered kernel; rows where
    row_ok is False and columns where head_ok is False (head-dim padding) read as zero."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    idx = (*lead, pl.ds(start, size), pl.ds(col, width))
    mask = head_ok
    if row_ok is not None:
        mask = row_ok[:, None] if mask is None else (row_ok[:, None] & mask)
    if mask is None:
        return ref[idx]
    return pltr.load(ref.at[idx], mask=mask, other=0.0)


def block_row(ref, table_ref, pos):
    """(leading index, row) of slot pos for `load_rows`: ((), pos) in a dense ref [S, H]
    (table_ref None); in a paged ref [num_blocks, block_size, H] read through table_ref
    [max_blocks], its block and offset (the rows loaded from there must stay in that block)."""
    if table_ref is None:
        return (), pos
    page = ref.shape[1]
    return (table_ref[jax.lax.div(pos, page)],), jax.lax.rem(pos, page)


def gather_rows(ref, table_ref, start, size, width, head_ok, row_ok):
    """Loads slots [start, start + size) of a paged ref [num_blocks, block_size, H] through
    table_ref [max_blocks], each row from its own block (the range may cross blocks); rows
    where row_ok is False and columns where head_ok is False read as zero."""
    from jax.experimental.pallas import triton as pltr

    page = ref.shape[1]
    slots = start + jax.lax.iota(jnp.int32, size)
    blocks = table_ref[jnp.minimum(jax.lax.div(slots, page), table_ref.shape[0] - 1)]
    cols = jax.lax.iota(jnp.int32, width)
    idx = (blocks[:, None], jax.lax.rem(slots, page)[:, None], cols[None, :])
    mask = row_ok[:, None] if head_ok is None else row_ok[:, None] & head_ok
    return pltr.load(ref.at[idx], mask=mask, other=0.0)


def cache_operands(k_cache, v_cache, block_k: int, min_slots: int, hp: int, interpret: bool,
                   what: str):
    """(block_k, operands, their BlockSpecs) of the caches for a kernel whose grid starts
    (row, KV head): dense [B, K, S, H], each program's row and KV head (S padded to min_slots
    so that every masked load of a tiny cache stays in bounds); `paged.Pages`, its KV head of
    the pools, then its row of the table, block_k cut to a divisor of the block size so that
    an aligned step of block_k slots lies in one block (`block_row`)."""
    from jax.experimental import pallas as pl

    from pallas_kernels.paged import Pages

    if not isinstance(k_cache, Pages):
        s = k_cache.shape[2]
        if s < min_slots:
            pad = ((0, 0), (0, 0), (0, min_slots - s), (0, 0))
            k_cache, v_cache, s = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), min_slots
        spec = pl.BlockSpec((None, None, s, hp), lambda bi, hi, *_: (bi, hi, 0, 0))
        return block_k, (k_cache, v_cache), [spec, spec]
    num_blocks, _, size, _ = k_cache.pool.shape
    block_k = min(block_k, size)
    if size % block_k or (block_k < 16 and not interpret):
        raise NotImplementedError(f"{what}: blocks of {size} slots are not whole steps of >= 16 "
                                  "slots")
    table = k_cache.table
    pool = pl.BlockSpec((num_blocks, None, size, hp), lambda bi, hi, *_: (0, hi, 0, 0))
    return block_k, (k_cache.pool, v_cache.pool, table), [
        pool, pool, pl.BlockSpec((None, table.shape[1]), lambda bi, *_: (bi, 0))]
