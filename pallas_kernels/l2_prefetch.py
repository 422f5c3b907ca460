"""Warm the L2 cache with the next weights while latency-bound kernels run (Hopper, TMA):
an experiment, measured not to help, kept for `bench/probe_l2_prefetch.py`.

Between a batch-1 decode step's weight-streaming matmuls run small kernels (norms, RoPE, the
attention over the cache, residual adds) that are bound by launch latency, not bytes: the
HBM sits idle for ~1-10 us at each of them. `l2_prefetch` launches, at that point, a kernel
whose blocks launch `cp.async.bulk.prefetch.L2` for the first `nbytes` of the weights the next
matmul reads, in the hope that the matmul then finds its first tiles there.

Placement is by data dependence, not by stream order: the kernel takes `after` (an activation
the small kernels consume) and returns a copy of it that they read instead, so XLA runs it
after `after` is produced and before its readers, and cannot drop it.

Measured on the H200 (docs/experiments.md): the kernel costs 2-5 us and the matmul
after it is no faster; a Qwen3-8B decode step with it ran 0.3-25% slower. The model option
that placed it in every one-token layer was removed after that run (commit 1cbfd00 has it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common

BOX = 256  # TMA box edge limit (elements per dimension)
MAX_BLOCKS = 132  # one wave on an H100 / H200
MAX_AFTER = BOX * BOX  # elements of the passed-through value: one TMA box, 128 KB in bf16


def _box(rows: int, cols: int) -> tuple[int, int] | None:
    """The largest TMA box (<= 256 x 256) tiling [rows, cols], or None."""
    box_cols = next((c for c in (BOX, 128, 64, 32, 16, 8) if cols % c == 0), None)
    box_rows = next((r for r in (BOX, 128, 64, 32, 16, 8) if rows % r == 0), None)
    return None if box_cols is None or box_rows is None else (box_rows, box_cols)


def plan(weights, nbytes: int) -> list[tuple[int, int, int, int]]:
    """Per 2-D weight [rows, cols]: (rows to prefetch, box rows, box cols, boxes), the rows
    being the leading ones that make up about nbytes in all (shared in proportion to size)."""
    total = sum(w.size * w.dtype.itemsize for w in weights)
    out = []
    for w in weights:
        rows, cols = w.shape
        box = _box(rows, cols)
        if box is None:
            raise NotImplementedError(f"l2_prefetch: no TMA box tiles a [{rows}, {cols}] weight")
        share = nbytes * (w.size * w.dtype.itemsize) / total
        want = min(rows, common.round_up(int(share // (cols * w.dtype.itemsize)), box[0]))
        out.append((want, *box, (want // box[0]) * (cols // box[1])))
    return out


def l2_prefetch(after, weights, nbytes: int, *, interpret: bool = False):
    """Returns a copy of `after` (use it in place of the original); on the way, asks L2 for
    the first ~nbytes of `weights` (arrays of any rank, as [all but the last dim, last dim]).
    nbytes <= 0 or no weights: no kernel. Raises NotImplementedError for a weight no TMA box
    tiles, or an `after` it cannot copy (over MAX_AFTER elements, size not a multiple of
    256). interpret=True: Mosaic GPU interpret mode (the prefetch is a no-op there).

    The copy is what keeps the kernel: an output nobody reads is dead code to XLA (a Pallas
    call has no side effects), and input/output aliasing is not offered by `plgpu.kernel`."""
    flat = [w.reshape(-1, w.shape[-1]) for w in weights]
    if nbytes <= 0 or not flat:
        return after
    if after.size > MAX_AFTER or after.size % BOX:
        raise NotImplementedError(f"l2_prefetch: cannot pass through {after.shape} (needs a "
                                  f"multiple of {BOX} elements, at most {MAX_AFTER})")
    layout = tuple(plan(flat, nbytes))
    if not any(boxes for *_, boxes in layout):
        return after
    rows = after.size // BOX
    kernel = _kernel(layout, rows, jnp.dtype(after.dtype), bool(interpret))
    return kernel(after.reshape(rows, BOX), *flat).reshape(after.shape)


@functools.lru_cache(maxsize=None)
def _kernel(layout, rows, dtype, interpret):
    blocks = min(MAX_BLOCKS, sum(boxes for *_, boxes in layout))

    def body(after_ref, *refs):
        *w_refs, out_ref = refs
        block = lax.axis_index("b")
        for w_ref, (_, box_rows, box_cols, boxes) in zip(w_refs, layout):
            per_row = w_ref.shape[1] // box_cols
            for i in range(common.cdiv(boxes, blocks)):  # boxes block, block + blocks, ...
                box = block + i * blocks

                @pl.when(box < boxes)
                def _(box=box, w_ref=w_ref, per_row=per_row, box_rows=box_rows,
                      box_cols=box_cols):
                    r, c = lax.div(box, per_row), lax.rem(box, per_row)
                    plgpu.async_prefetch(w_ref.at[pl.ds(r * box_rows, box_rows),
                                                  pl.ds(c * box_cols, box_cols)])

        @pl.when(block == 0)
        def _():
            def copy(smem, barrier):
                plgpu.copy_gmem_to_smem(after_ref, smem, barrier.at[0])
                plgpu.barrier_wait(barrier.at[0])
                plgpu.copy_smem_to_gmem(smem, out_ref)
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(copy, plgpu.SMEM((rows, BOX), dtype), plgpu.Barrier(num_barriers=1))

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((rows, BOX), dtype),
                          grid=(blocks,), grid_names=("b",))
    if not interpret:
        return kernel

    def run(*args):
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            return kernel(*args)

    return run
