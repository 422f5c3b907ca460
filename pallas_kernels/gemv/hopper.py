"""Weight-streaming matmul for few rows on Hopper (sm_90): Pallas Mosaic GPU, TMA + wgmma.

The Triton-lowered kernels of this package stream mid-sized weights at 54-77% of the H200's
4.25 TB/s where XLA's GEMV reaches 86% inside a decode step (docs/benchmarks.md).
This one moves the weight tiles with TMA into a ring of `stages` shared-memory buffers,
issued `stages - 1` steps ahead, and multiplies on the tensor cores with the weight as the
wide operand: y^T [block_n, M8] += w_tile^T [block_n, block_k] @ x_tile^T [block_k, M8]
(wgmma's M = block_n, its N = M8 = the rows rounded up to 8: 8 x the work of the rows
themselves, where x-as-M would pad 1 row to 64). Both operands are read transposed from
shared memory, as the tiles lie in global memory; nothing is copied.

Grid: (column strips of block_n, K splits). Each program writes its float32 partial y^T
[block_n, M8]; the wrapper sums the splits, transposes and casts (one small XLA fusion).
Shapes it does not serve raise NotImplementedError: K not a multiple of block_k, N not a
multiple of block_n, M > 32, dtypes other than bf16 / f16, devices other than sm_90.

On the H200 (docs/experiments.md) it streams gate/up
[4096, 12288] at 82% (XLA 78%, Triton 79% in the same chain) but down and q/o no better than
XLA, and a Qwen3-8B step with it takes 4.93 against XLA's 4.75 ms: opt-in.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.gemv.kernel import MAX_ROWS

SMEM_BYTES = 220 * 1024  # of the H100 / H200's 227 KB per block, with room for barriers
ROW_ALIGN = 8  # wgmma's N granule: the rows are padded to a multiple of it


@dataclasses.dataclass(frozen=True)
class HopperGemvConfig:
    """block_k x block_n: the weight tile one TMA copy loads (block_n: 64 or 128, wgmma's M;
    block_k: a multiple of 64). stages: shared-memory buffers in the ring. num_splits: split-K
    factor (None: enough programs for about two per SM)."""

    block_k: int = 128
    block_n: int = 64
    stages: int = 4
    num_splits: int | None = None


def hopper_config(k: int, n: int) -> HopperGemvConfig:
    """Default config: 128-deep tiles where K allows (else 64), 64 columns; splits automatic.
    The best of the eight configs swept on the H200 for gate/up and down at M = 1."""
    return HopperGemvConfig(block_k=128 if k % 128 == 0 else 64)


def smem_bytes(config: HopperGemvConfig, rows: int, itemsize: int = 2) -> int:
    """Shared memory of one program: the ring of weight and x tiles and the output tile."""
    tiles = config.stages * (config.block_k * config.block_n + rows * config.block_k)
    return tiles * itemsize + config.block_n * rows * 4


def auto_splits(k: int, n: int, config: HopperGemvConfig, *, sms: int | None = None) -> int:
    """About two programs per SM, each split at least two K blocks."""
    sms = common.num_sms() if sms is None else sms
    strips = n // config.block_n
    k_blocks = k // config.block_k
    return max(1, min(common.cdiv(2 * sms, strips), k_blocks // 2 or 1))


def problem(x, w, config: HopperGemvConfig, *, interpret: bool) -> str | None:
    """What the kernel cannot serve in x [M, K] @ w [K, N] and config, or None."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return f"needs x [M, K] @ w [K, N], got {x.shape} @ {w.shape}"
    m, k = x.shape
    n = w.shape[1]
    if not 1 <= m <= MAX_ROWS:
        return f"M={m} rows outside [1, {MAX_ROWS}]"
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                          jnp.dtype(jnp.float16)):
        return f"dtypes {x.dtype} @ {w.dtype} (needs bf16 or f16 for both)"
    if config.block_n not in (64, 128) or config.block_k % 64 or config.block_k < 64:
        return f"tile {config.block_k}x{config.block_n} (block_n 64 or 128, block_k k*64)"
    if k % config.block_k or n % config.block_n:
        return f"K={k} or N={n} not a multiple of the tile {config.block_k}x{config.block_n}"
    rows = common.round_up(m, ROW_ALIGN)
    if smem_bytes(config, rows, x.dtype.itemsize) > SMEM_BYTES:
        return f"{smem_bytes(config, rows, x.dtype.itemsize)} bytes of shared memory"
    if not interpret:
        platform, cc, _ = common.device_info()
        if platform == "gpu" and not str(cc).startswith("9"):
            return f"needs sm_90 (wgmma), device has compute capability {cc}"
    return None


def _build(*, rows, k, n, dtype, block_k, block_n, stages, chunk, splits, interpret):
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)

    def body(x_ref, w_ref, o_ref):
        j = lax.axis_index("n")
        split = lax.axis_index("s")
        k0 = split * chunk
        steps = lax.div(jnp.minimum(chunk, k - k0), jnp.int32(block_k))
        cols = pl.ds(j * block_n, block_n)

        def scoped(w_smem, x_smem, o_smem, w_bar, x_bar):
            def fetch(step):
                slot = lax.rem(step, jnp.int32(stages))
                kk = pl.ds(k0 + step * block_k, block_k)
                plgpu.copy_gmem_to_smem(w_ref.at[kk, cols], w_smem.at[slot], w_bar.at[slot])
                plgpu.copy_gmem_to_smem(x_ref.at[:, kk], x_smem.at[slot], x_bar.at[slot])

            for i in range(stages - 1):
                @pl.when(i < steps)
                def _():
                    fetch(jnp.int32(i))

            def step_fn(step, acc):
                slot = lax.rem(step, jnp.int32(stages))

                # The slot refilled here was read by the previous step's wgmma, which has
                # completed: its result was read into the carried accumulator.
                @pl.when(step + (stages - 1) < steps)
                def _():
                    fetch(step + (stages - 1))

                plgpu.barrier_wait(w_bar.at[slot])
                plgpu.barrier_wait(x_bar.at[slot])
                a = w_smem.at[slot].transpose((1, 0))  # [block_n, block_k]
                b = x_smem.at[slot].transpose((1, 0))  # [block_k, rows]
                if interpret:
                    # GPU interpret mode has no pre-initialised accumulators: a fresh one,
                    # added in registers (same result).
                    def fresh(acc_ref):
                        plgpu.wgmma(acc_ref, a, b)
                        return acc_ref[...]

                    return acc + pl.run_scoped(fresh, plgpu.ACC((block_n, rows), jnp.float32))

                def accumulate(acc_ref):
                    plgpu.wgmma(acc_ref, a, b)

                return pl.run_state(accumulate)(plgpu.ACC.init(acc))

            acc = plgpu.layout_cast(jnp.zeros((block_n, rows), jnp.float32),
                                    plgpu.Layout.WGMMA)
            acc = lax.fori_loop(0, steps, step_fn, acc)
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, cols])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((stages, block_k, block_n), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, rows, block_k), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((block_n, rows), jnp.float32),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        )

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
        grid=(n // block_n, splits),
        grid_names=("n", "s"),
    )


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def small_m_matmul_hopper(x, w, *, out_dtype=None, config: HopperGemvConfig | None = None,
                          interpret: bool = False):
    """x [M, K] @ w [K, N] -> [M, N] (out_dtype, default x.dtype), float32 accumulation, on
    sm_90. interpret=True (or a `plgpu.InterpretGPUParams`, e.g. with detect_races=True):
    Mosaic GPU interpret mode (CPU)."""
    config = config or hopper_config(x.shape[-1], w.shape[-1])
    why = problem(x, w, config, interpret=interpret)
    if why is not None:
        raise NotImplementedError(f"hopper GEMV kernel: {why}")
    m, k = x.shape
    n = w.shape[1]
    rows = common.round_up(m, ROW_ALIGN)
    k_blocks = k // config.block_k
    want = min(config.num_splits or auto_splits(k, n, config), k_blocks)
    chunk = common.cdiv(k_blocks, want) * config.block_k
    splits = common.cdiv(k, chunk)
    kernel = _build(rows=rows, k=k, n=n, dtype=x.dtype, block_k=config.block_k,
                    block_n=config.block_n, stages=config.stages, chunk=chunk, splits=splits,
                    interpret=bool(interpret))
    x_rows = jnp.pad(x, ((0, rows - m), (0, 0)))
    if interpret:
        params = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else (
            plgpu.InterpretGPUParams())
        with plgpu.force_gpu_interpret_mode(params):
            parts = kernel(x_rows, w)
    else:
        parts = kernel(x_rows, w)
    y = jnp.sum(parts, axis=0)[:, :m].T  # [M, N]
    return y.astype(x.dtype if out_dtype is None else out_dtype)
