"""Expert-major grouped matmul for MoE passes with many (token, expert) pairs (speculative
verify, prefill), Pallas with the Triton lowering (any NVIDIA GPU): rows sorted by expert,
y[rows of e] = x[rows of e] @ w[e], x [P, K], w [E, K, N], group_sizes [E] (sum P); the
contract of `jax.lax.ragged_dot(x, w, group_sizes)`.

The cost to beat is reading each touched expert's [K, N] weights once. The grid is (experts,
column strips of block_n, K splits); a program reads its expert's row offset (exclusive
cumsum of group_sizes, a small int32 input) and size. An expert without rows reads and
writes nothing (rows belong to their own expert's programs, so each output row is written
once, by the programs of its expert). Otherwise the program streams its expert's
[chunk, block_n] weight slab in [block_k, block_n] tiles and multiplies each tile, while it
is loaded, by up to `row_blocks` 16-row blocks of the expert's rows (16: the smallest Triton
dot; rows past the group masked; blocks past the group skipped by a branch), one float32
[16, block_n] accumulator per block: K loop outside, row-block loop inside, so a group of up
to 16 * row_blocks rows (64 by default) reads each weight tile once. Larger groups take
several such passes, each streaming the slab again. Split-K partials [splits, P, N] are
summed by a small XLA epilogue, as in `kernel.py`; K and N tails are masked loads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.gemv.config import GemvConfig, SortedConfig, sorted_config
from pallas_kernels.gemv.kernel import (_outer, operand_problem, split_k, split_output,
                                        stream_k, sum_splits)

ROWS = 16  # rows of one row block: the smallest dot Triton emits


def _kernel(offsets_ref, sizes_ref, x_ref, w_ref, o_ref, *, num_rows, k, n, block_k, block_n,
            chunk, num_splits, row_blocks, evict_first, precision, interpret):
    e, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = offsets_ref[e]
    # Clamped so that malformed sizes (sum > P) can never touch rows outside x and o.
    size = jnp.clip(sizes_ref[e], 0, jnp.maximum(num_rows - start, 0))
    k0 = split * chunk
    cols = pl.ds(j * block_n, block_n)
    col_ok = None if n % block_n == 0 else j * block_n + lax.iota(jnp.int32, block_n) < n
    evict = "evict_first" if evict_first else None
    iota = lax.iota(jnp.int32, ROWS)
    pass_rows = ROWS * row_blocks

    def row_pass(q, carry):
        first = start + q * pass_rows  # this pass's first row
        left = size - q * pass_rows  # > 0: rows of the group from `first` on

        def step(i, accs, tail):
            kk = k0 + i * block_k
            k_ok = kk + lax.iota(jnp.int32, block_k) < k if tail else None
            w_mask = _outer(k_ok, col_ok, (block_k, block_n))
            ws = pltr.load(w_ref.at[e, pl.ds(kk, block_k), cols], mask=w_mask,
                           other=None if w_mask is None else 0, eviction_policy=evict)

            def add(r, acc):
                x_mask = _outer(r * ROWS + iota < left, k_ok, (ROWS, block_k))
                xs = pltr.load(x_ref.at[pl.ds(first + r * ROWS, ROWS), pl.ds(kk, block_k)],
                               mask=x_mask, other=0)
                return acc + common.kernel_dot(xs, ws, precision=precision, upcast=interpret)

            # Block 0 always has rows; the others only for groups that reach them.
            return tuple(add(r, acc) if r == 0 else
                         lax.cond(r * ROWS < left, functools.partial(add, r), lambda a: a, acc)
                         for r, acc in enumerate(accs))

        accs = tuple(jnp.zeros((ROWS, block_n), jnp.float32) for _ in range(row_blocks))
        accs = stream_k(step, accs, k0=k0, chunk=chunk, k=k, block_k=block_k)
        for r, acc in enumerate(accs):
            rows = pl.ds(first + r * ROWS, ROWS)
            dst = o_ref.at[rows, cols] if num_splits == 1 else o_ref.at[split, rows, cols]
            pltr.store(dst, acc.astype(o_ref.dtype),
                       mask=_outer(r * ROWS + iota < left, col_ok, (ROWS, block_n)))
        return carry

    @pl.when(size > 0)
    def _():
        lax.fori_loop(0, lax.div(size + pass_rows - 1, pass_rows), row_pass, jnp.int32(0))


def supported(x, w, group_sizes, config: GemvConfig) -> str | None:
    """None if the kernel serves these operands, else the reason."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        return f"needs x [P, K] and w [E, K, N], got {x.shape} and {w.shape}"
    if group_sizes.shape != w.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        return (f"needs integer group_sizes [E={w.shape[0]}], got "
                f"{group_sizes.dtype}{group_sizes.shape}")
    if x.size >= 2**31:
        return f"x has {x.size} elements: int32 offsets would overflow"
    if not 1 <= getattr(config, "row_blocks", 1) <= 16:
        return f"row_blocks={config.row_blocks} outside [1, 16]"
    return operand_problem(x, w, config, rows="P", unit="rows", max_rows=None)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_matmul_sorted_pallas(x, w, group_sizes, *, out_dtype=None,
                                 config: GemvConfig | None = None, interpret: bool = False):
    """x [P, K] (rows sorted by expert), w [E, K, N], group_sizes [E] (sum P) -> [P, N]:
    rows offsets[e] : offsets[e] + group_sizes[e] times w[e] (= `lax.ragged_dot`; rows past
    sum(group_sizes) are zero), out_dtype (default x.dtype), float32 accumulation. config: a
    `SortedConfig` (a plain `GemvConfig` gets the default row_blocks; None: heuristic)."""
    num_rows, k = x.shape
    num_experts, _, n = w.shape
    cfg = config or sorted_config(num_rows, num_experts, k, n)
    if not isinstance(cfg, SortedConfig):
        cfg = SortedConfig(**dataclasses.asdict(cfg))
    why = supported(x, w, group_sizes, cfg)
    if why is not None:
        raise NotImplementedError(f"expert-major grouped matmul kernel: {why}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    chunk, splits = split_k(k, cfg.block_k, cfg.num_splits or sorted_config(
        num_rows, num_experts, k, n).num_splits)
    if splits * num_rows * n >= 2**31:
        raise NotImplementedError(f"expert-major grouped matmul kernel: {splits} partials of "
                                  f"[{num_rows}, {n}]: int32 offsets would overflow")
    sizes = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(sizes) - sizes  # exclusive
    kernel = functools.partial(
        _kernel, num_rows=num_rows, k=k, n=n, block_k=cfg.block_k, block_n=cfg.block_n,
        chunk=chunk, num_splits=splits,
        row_blocks=min(cfg.row_blocks, common.cdiv(num_rows, ROWS)),
        evict_first=cfg.evict_first,
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None,
        interpret=interpret)
    out_spec, out_shape = split_output(num_rows, n, splits, out_dtype)
    out = pl.pallas_call(
        kernel,
        grid=(num_experts, common.cdiv(n, cfg.block_n), splits),
        in_specs=[pl.BlockSpec((num_experts,), lambda e, j, s: (0,)),
                  pl.BlockSpec((num_experts,), lambda e, j, s: (0,)),
                  pl.BlockSpec((num_rows, k), lambda e, j, s: (0, 0)),
                  pl.BlockSpec(w.shape, lambda e, j, s: (0, 0, 0))],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="grouped_matmul_sorted",
    )(offsets, sizes, x, w)
    out = sum_splits(out, splits, out_dtype)
    # Rows past sum(group_sizes) belong to no expert: nothing wrote them (ragged_dot: zero).
    covered = lax.iota(jnp.int32, num_rows) < jnp.sum(sizes)
    return jnp.where(covered[:, None], out, 0).astype(out_dtype)
