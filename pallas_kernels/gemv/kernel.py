"""Weight-streaming matmul for few rows (decode: M = batch * tokens <= 32), Pallas with the
Triton lowering (any NVIDIA GPU).

y [M, N] = x [M, K] @ w [K, N], w row-major (N contiguous). At small M the cost is reading w
once, so the grid is (column strips of block_n, K splits): each program streams the
[chunk, block_n] slab of w it owns in [block_k, block_n] tiles (coalesced along N, pipelined
over `num_stages`), multiplies them by the matching x columns and accumulates in float32.
Split-K keeps every SM busy when N has few strips (k/v projections: 1024 columns); the
per-split float32 partials [splits, M, N] are summed by a small XLA epilogue (which XLA fuses
into the consumer). K and N need not be multiples of the block: the tails are masked loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.gemv.config import GemvConfig, auto_num_splits, gemv_config

MAX_ROWS = 32
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _kernel(x_ref, w_ref, o_ref, *, m, k, n, block_m, block_k, block_n, chunk, num_splits,
            use_dot, evict_first, precision, interpret):
    j, split = pl.program_id(0), pl.program_id(1)
    k0 = split * chunk
    cols = pl.ds(j * block_n, block_n)
    col_ok = None if n % block_n == 0 else j * block_n + lax.iota(jnp.int32, block_n) < n
    row_ok = None if m == block_m else lax.iota(jnp.int32, block_m) < m
    evict = "evict_first" if evict_first else None

    def step(i, acc, tail):
        kk = k0 + i * block_k
        k_ok = kk + lax.iota(jnp.int32, block_k) < k if tail else None
        x_idx = (pl.ds(0, block_m), pl.ds(kk, block_k))
        x_mask = _outer(row_ok, k_ok, (block_m, block_k))
        xs = pltr.load(x_ref.at[x_idx], mask=x_mask, other=None if x_mask is None else 0)
        w_mask = _outer(k_ok, col_ok, (block_k, block_n))
        ws = pltr.load(w_ref.at[pl.ds(kk, block_k), cols], mask=w_mask,
                       other=None if w_mask is None else 0, eviction_policy=evict)
        if use_dot:
            return acc + common.kernel_dot(xs, ws, precision=precision, upcast=interpret)
        return acc + xs.astype(jnp.float32)[:, :, None] * ws.astype(jnp.float32)[None, :, :]

    acc = jnp.zeros((block_m, block_n) if use_dot else (block_m, block_k, block_n), jnp.float32)
    acc = stream_k(step, acc, k0=k0, chunk=chunk, k=k, block_k=block_k)
    if not use_dot:
        acc = jnp.sum(acc, axis=1)

    out_idx = (pl.ds(0, block_m), cols)
    dst = o_ref.at[out_idx] if num_splits == 1 else o_ref.at[(split,) + out_idx]
    pltr.store(dst, acc.astype(o_ref.dtype), mask=_outer(row_ok, col_ok, (block_m, block_n)))


def stream_k(step, acc, *, k0, chunk, k, block_k):
    """Runs `step(i, acc, tail)` over the K blocks of the split starting at k0; tail=True
    masks the last, partial block, which only the split holding the end of K has."""
    k_len = jnp.minimum(chunk, k - k0)
    n_full = lax.div(k_len, block_k)
    acc = lax.fori_loop(0, n_full, functools.partial(step, tail=False), acc)
    if k % block_k:
        n_all = lax.div(k_len + block_k - 1, block_k)
        acc = lax.fori_loop(n_full, n_all, functools.partial(step, tail=True), acc)
    return acc


def split_k(k: int, block_k: int, want: int) -> tuple[int, int]:
    """(chunk, splits): K cut into about `want` chunks of whole blocks, none of them empty."""
    k_blocks = common.cdiv(k, block_k)
    chunk = common.cdiv(k_blocks, min(want, k_blocks)) * block_k
    return chunk, common.cdiv(k, chunk)


def split_output(rows: int, n: int, splits: int, out_dtype):
    """(out_specs, out_shape) of a kernel's whole output: [rows, N] in out_dtype, or with
    split-K the float32 partials [splits, rows, N] that `sum_splits` adds up."""
    shape = (rows, n) if splits == 1 else (splits, rows, n)
    dtype = out_dtype if splits == 1 else jnp.float32
    return whole_block(shape), jax.ShapeDtypeStruct(shape, dtype)


def whole_block(shape):
    """A BlockSpec that hands every program the whole array (the kernels index it)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def sum_splits(out, splits: int, out_dtype):
    """The XLA epilogue of split-K: partials [splits, rows, N] -> [rows, N] in out_dtype."""
    return out if splits == 1 else jnp.sum(out, axis=0).astype(out_dtype)


def _outer(rows_ok, cols_ok, shape):
    """Mask of a tile of `shape` from optional row and column masks; None when all valid."""
    if rows_ok is None and cols_ok is None:
        return None
    if rows_ok is None:
        return jnp.broadcast_to(cols_ok[None, :], shape)
    if cols_ok is None:
        return jnp.broadcast_to(rows_ok[:, None], shape)
    return rows_ok[:, None] & cols_ok[None, :]


def operand_problem(x, w, config: GemvConfig, rows: str = "M", unit: str = "rows",
                    max_rows: int | None = MAX_ROWS) -> str | None:
    """What the kernels cannot serve in x [rows, K], w [..., K, N] and config, or None.
    max_rows: the most rows the kernel takes (None: no limit)."""
    if x.shape[0] < 1 or (max_rows is not None and x.shape[0] > max_rows):
        return f"{rows}={x.shape[0]} {unit} outside [1, {max_rows or 'inf'}]"
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in DTYPES:
        return f"dtypes {x.dtype} @ {w.dtype} (needs one of bf16, f16, f32 for both)"
    if w.size >= 2**31:
        return f"w has {w.size} elements: int32 offsets would overflow"
    for name, b in (("block_k", config.block_k), ("block_n", config.block_n)):
        if b < 16 or b & (b - 1):
            return f"{name}={b} must be a power of two >= 16"
    return None


def supported(x, w, config: GemvConfig) -> str | None:
    """None if the kernel serves these operands, else the reason."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"needs x [M, K] @ w [K, N], got {x.shape} @ {w.shape}"
    if not config.use_dot and x.shape[0] > 4:
        return f"broadcast-reduce form serves M <= 4, got M={x.shape[0]}"
    return operand_problem(x, w, config)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def small_m_matmul_pallas(x, w, *, out_dtype=None, config: GemvConfig | None = None,
                          interpret: bool = False):
    """x [M, K] @ w [K, N] -> [M, N] (out_dtype, default x.dtype), float32 accumulation."""
    m, k = x.shape
    n = w.shape[1]
    cfg = config or gemv_config(m, k, n)
    why = supported(x, w, cfg)
    if why is not None:
        raise NotImplementedError(f"small-M matmul kernel: {why}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    block_m = max(16, common.next_pow2(m)) if cfg.use_dot else common.next_pow2(m)
    chunk, splits = split_k(k, cfg.block_k, cfg.num_splits or auto_num_splits(
        m, k, n, cfg.block_k, cfg.block_n))
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, m=m, k=k, n=n, block_m=block_m, block_k=cfg.block_k, block_n=cfg.block_n,
        chunk=chunk, num_splits=splits, use_dot=cfg.use_dot, evict_first=cfg.evict_first,
        precision=precision, interpret=interpret)
    out_spec, out_shape = split_output(m, n, splits, out_dtype)
    out = pl.pallas_call(
        kernel,
        grid=(common.cdiv(n, cfg.block_n), splits),
        in_specs=[pl.BlockSpec((m, k), lambda j, s: (0, 0)),
                  pl.BlockSpec((k, n), lambda j, s: (0, 0))],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="small_m_matmul",
    )(x, w)
    return sum_splits(out, splits, out_dtype)
