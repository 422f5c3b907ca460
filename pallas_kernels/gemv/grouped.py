"""Grouped weight-streaming matmul for MoE decode, Pallas with the Triton lowering (any NVIDIA
GPU): y[p] = x[p] @ w[experts[p]] for P (token, expert) pairs, x [P, K], w [E, K, N].

At batch-1 decode each pair's cost is reading its expert's [K, N] weights once. The grid is
(pairs, column strips of block_n, K splits); a program reads its pair's expert id from the
small int32 `experts` input and streams that expert's [chunk, block_n] slab in place (the id
goes into the weight offset: no gathered copy of the weights), in [block_k, block_n] tiles.
Pairs vary fastest, so pairs that share an expert read the same tile at about the same time
(L2 hits). Split-K partials [splits, P, N] are summed by a small XLA epilogue, as in
`kernel.py`; K and N tails are masked loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.gemv.config import GemvConfig, auto_num_splits, grouped_config
from pallas_kernels.gemv.kernel import (_outer, operand_problem, split_k, split_output,
                                        stream_k, sum_splits)

DOT_ROWS = 16  # the smallest dot Triton emits: the pair's row, then zero rows


def _kernel(experts_ref, x_ref, w_ref, o_ref, *, num_experts, k, n, block_k, block_n, chunk,
            num_splits, use_dot, evict_first, precision, interpret):
    p, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # Clamped so that a bad id can never read outside w (ids must be in [0, E)).
    e = jnp.clip(experts_ref[p], 0, num_experts - 1)
    k0 = split * chunk
    cols = pl.ds(j * block_n, block_n)
    col_ok = None if n % block_n == 0 else j * block_n + lax.iota(jnp.int32, block_n) < n
    evict = "evict_first" if evict_first else None
    first_row = lax.iota(jnp.int32, DOT_ROWS)[:, None] == 0

    def step(i, acc, tail):
        kk = k0 + i * block_k
        k_ok = kk + lax.iota(jnp.int32, block_k) < k if tail else None
        xs = pltr.load(x_ref.at[p, pl.ds(kk, block_k)], mask=k_ok,
                       other=None if k_ok is None else 0)  # [block_k]
        w_mask = _outer(k_ok, col_ok, (block_k, block_n))
        ws = pltr.load(w_ref.at[e, pl.ds(kk, block_k), cols], mask=w_mask,
                       other=None if w_mask is None else 0, eviction_policy=evict)
        if use_dot:
            x_rows = jnp.where(first_row, xs[None, :], jnp.zeros((), xs.dtype))
            return acc + common.kernel_dot(x_rows, ws, precision=precision, upcast=interpret)
        return acc + xs.astype(jnp.float32)[:, None] * ws.astype(jnp.float32)

    acc = jnp.zeros((DOT_ROWS if use_dot else block_k, block_n), jnp.float32)
    acc = stream_k(step, acc, k0=k0, chunk=chunk, k=k, block_k=block_k)
    y = jnp.sum(acc, axis=0)  # dot form: rows other than the first are exactly zero

    dst = o_ref.at[p, cols] if num_splits == 1 else o_ref.at[split, p, cols]
    pltr.store(dst, y.astype(o_ref.dtype), mask=col_ok)


def supported(x, w, experts, config: GemvConfig) -> str | None:
    """None if the kernel serves these operands, else the reason."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        return f"needs x [P, K] and w [E, K, N], got {x.shape} and {w.shape}"
    if experts.shape != x.shape[:1] or not jnp.issubdtype(experts.dtype, jnp.integer):
        return f"needs integer experts [P={x.shape[0]}], got {experts.dtype}{experts.shape}"
    return operand_problem(x, w, config, rows="P", unit="pairs")


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_small_m_matmul_pallas(x, w, experts, *, out_dtype=None,
                                  config: GemvConfig | None = None, interpret: bool = False):
    """x [P, K], w [E, K, N], experts [P] -> [P, N] with y[p] = x[p] @ w[experts[p]]
    (out_dtype, default x.dtype), float32 accumulation."""
    num_pairs, k = x.shape
    num_experts, _, n = w.shape
    cfg = config or grouped_config(num_pairs, k, n)
    why = supported(x, w, experts, cfg)
    if why is not None:
        raise NotImplementedError(f"grouped small-M matmul kernel: {why}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    chunk, splits = split_k(k, cfg.block_k, cfg.num_splits or auto_num_splits(
        1, k, n, cfg.block_k, cfg.block_n, groups=num_pairs))
    kernel = functools.partial(
        _kernel, num_experts=num_experts, k=k, n=n, block_k=cfg.block_k, block_n=cfg.block_n,
        chunk=chunk, num_splits=splits, use_dot=cfg.use_dot, evict_first=cfg.evict_first,
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None,
        interpret=interpret)
    out_spec, out_shape = split_output(num_pairs, n, splits, out_dtype)
    out = pl.pallas_call(
        kernel,
        grid=(num_pairs, common.cdiv(n, cfg.block_n), splits),
        in_specs=[pl.BlockSpec((num_pairs,), lambda p, j, s: (0,)),
                  pl.BlockSpec((num_pairs, k), lambda p, j, s: (0, 0)),
                  pl.BlockSpec(w.shape, lambda p, j, s: (0, 0, 0))],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_small_m_matmul",
    )(experts.astype(jnp.int32), x, w)
    return sum_splits(out, splits, out_dtype)
