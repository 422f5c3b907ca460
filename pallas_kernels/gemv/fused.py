"""Decode-step projections with their neighbours folded in (Pallas, Triton lowering).

XLA runs a decode layer as a weight-streaming matmul per projection plus about a dozen small
kernels around them (the RMSNorms as a reduce and an apply, split-K sums, residual adds,
SiLU x up): about 0.8 ms of a 4.7 ms Qwen3-8B step on the H200. This kernel does one
projection group of a layer in one launch:

  norm prologue      x -> RMSNorm(x; g) before the product. Each program streams all of K
                     (or its split), so it sums x^2 on the way and scales its accumulator by
                     the row's 1/rms at the end: (x * g) @ W * rstd, the same product as
                     (x * rstd * g) @ W up to rounding.
  several weights    q, k and v (or any weights sharing x) in one grid, one output each.
  swiglu epilogue    gate and up read by the same program: silu(x @ gate) * (x @ up). The
                     model does not use it: gate and up as two outputs with SiLU x up in
                     the split-K epilogue streamed faster on the H200 (77% against 72%).
  residual epilogue  residual + x @ W, in the residual's dtype.

Without split-K the epilogues run in the kernel. With split-K the kernel writes float32
partials (and the partial sums of x^2) and one XLA fusion finishes them with the same epilogue
code. On the H200 split-K won every group (narrow strips without it streamed at ~55%), so in
practice the epilogues run in XLA and the fusion that remains is the norm and the launches.
Measured against XLA on the whole Qwen3-8B step this loses (4.88 against 4.72 ms:
docs/benchmarks.md), so the model runs it only on request (`matmul_impl="fused"`).

Weights are [K, N] row-major (N contiguous), as the model stores them; x is [M, K], M <= 32.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.gemv.kernel import _outer, operand_problem, stream_k, whole_block


_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class FusedGemvConfig:
    """block_k x block_n: the weight tile one loop step loads (powers of two, >= 16).
    num_splits: split-K factor (1: the epilogue runs in the kernel; None: automatic)."""

    block_k: int = 128
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None


def fused_config(k: int, strips: int, *, block_n: int = 128, sms: int | None = None
                 ) -> FusedGemvConfig:
    """Default config: [128, block_n] tiles, 3 stages, K split for about three programs per SM
    (at most 8 splits; strips: the grid's column strips at block_n). On the H200 the best
    configs of the Qwen3-8B groups were 128x128 with 4-8 splits or 256x64 with 2; narrow
    strips without split-K streamed at about half the bandwidth (53% for [12288, 4096] at 16
    columns against 82% at 64 columns and 2 splits): bench/results/fused_gemv*_h200_2026-11-30."""
    sms = common.num_sms() if sms is None else sms
    block_k = min(128, max(16, common.next_pow2(k)))
    splits = min(common.cdiv(3 * sms, strips), 8, common.cdiv(k, block_k))
    return FusedGemvConfig(block_k=block_k, block_n=block_n, num_splits=max(1, splits))


KEY_FIELDS = ("kernel", "M", "K", "widths", "norm", "residual", "swiglu", "dtype")


def table_key(m: int, k: int, widths, *, norm: bool, residual: bool, swiglu: bool, dtype):
    """What a tuned-table entry must match (KEY_FIELDS): the operands' shapes (M rounded up to
    a power of two), the prologue and epilogue, and the dtype."""
    return dict(zip(KEY_FIELDS, ("fused_gemv", common.next_pow2(m), k, list(widths), norm,
                                 residual, swiglu, str(jnp.dtype(dtype)))))


def table_path() -> Path | None:
    """This device's table (`tuned_fused_<device tag>.json` here, written by
    bench/bench_fused_gemv.py --write-table), or None off-GPU."""
    tag = common.device_tag()
    return None if tag is None else _HERE / f"tuned_fused_{tag}.json"


def tuned_fused_config(key: dict, path=None) -> FusedGemvConfig | None:
    """The table's config for a `table_key`, or None (no table or no entry)."""
    path = table_path() if path is None else Path(path)
    if path is None or not path.is_file():
        return None
    for e in common.load_tuned(str(path)):
        try:
            found = {f: e[f] for f in key} | {"M": common.next_pow2(e["M"])}
            if found == key:
                return FusedGemvConfig(**e["config"])
        except (KeyError, TypeError, ValueError):
            continue
    return None


def finish(accs, sum_sq, residual, *, k: int, eps: float, swiglu: bool, out_dtype):
    """The epilogue, in the kernel (tiles) or in XLA (summed split-K partials): float32
    accumulators [rows, cols] (one per weight) -> outputs in out_dtype. sum_sq [rows]: the
    rows' sums of x^2 (None: no norm). Each projection is rounded to out_dtype before the
    activation or the residual add, as the unfused model rounds it."""
    if sum_sq is not None:
        rstd = lax.rsqrt(sum_sq / k + eps)[:, None]
        accs = [acc * rstd for acc in accs]
    ys = [acc.astype(out_dtype) for acc in accs]
    if swiglu:
        gate, up = (y.astype(jnp.float32) for y in ys)
        ys = [(gate / (1.0 + jnp.exp(-gate)) * up).astype(out_dtype)]
    if residual is not None:
        ys = [(residual.astype(jnp.float32) + ys[0].astype(jnp.float32)).astype(out_dtype)]
    return ys


def _kernel(*refs, segments, num_weights, m, k, block_m, block_k, block_n, chunk, splits,
            norm, swiglu, residual, eps, precision, interpret, out_dtype):
    x_ref, refs = refs[0], refs[1:]
    g_ref, refs = (refs[0], refs[1:]) if norm else (None, refs)
    w_refs, refs = refs[:num_weights], refs[num_weights:]
    r_ref, out_refs = (refs[0], refs[1:]) if residual else (None, refs)
    j, split = pl.program_id(0), pl.program_id(1)
    k0 = split * chunk
    row_ok = None if m == block_m else lax.iota(jnp.int32, block_m) < m

    for seg, (first_strip, weights, n) in enumerate(segments):
        strips = common.cdiv(n, block_n)

        @pl.when((j >= first_strip) & (j < first_strip + strips))
        def _(seg=seg, first_strip=first_strip, weights=weights, n=n):
            col0 = (j - first_strip) * block_n
            cols = pl.ds(col0, block_n)
            col_ok = None if n % block_n == 0 else col0 + lax.iota(jnp.int32, block_n) < n

            def step(i, carry, tail):
                accs, sum_sq = carry
                kk = k0 + i * block_k
                k_ok = kk + lax.iota(jnp.int32, block_k) < k if tail else None
                x_mask = _outer(row_ok, k_ok, (block_m, block_k))
                xs = pltr.load(x_ref.at[pl.ds(0, block_m), pl.ds(kk, block_k)], mask=x_mask,
                               other=None if x_mask is None else 0)
                if norm:
                    x32 = xs.astype(jnp.float32)
                    sum_sq = sum_sq + jnp.sum(x32 * x32, axis=1)
                    gs = pltr.load(g_ref.at[pl.ds(kk, block_k)], mask=k_ok,
                                   other=None if k_ok is None else 0)
                    xs = (x32 * gs.astype(jnp.float32)[None, :]).astype(xs.dtype)
                w_mask = _outer(k_ok, col_ok, (block_k, block_n))
                new = []
                for acc, w in zip(accs, weights):
                    ws = pltr.load(w_refs[w].at[pl.ds(kk, block_k), cols], mask=w_mask,
                                   other=None if w_mask is None else 0,
                                   eviction_policy="evict_first")
                    new.append(acc + common.kernel_dot(xs, ws, precision=precision,
                                                       upcast=interpret))
                return tuple(new), sum_sq

            zeros = jnp.zeros((block_m, block_n), jnp.float32)
            carry = (tuple(zeros for _ in weights), jnp.zeros((block_m,), jnp.float32))
            accs, sum_sq = stream_k(step, carry, k0=k0, chunk=chunk, k=k, block_k=block_k)
            out_mask = _outer(row_ok, col_ok, (block_m, block_n))
            tile = (pl.ds(0, block_m), cols)
            if splits == 1:
                res = None
                if residual:
                    res = pltr.load(r_ref.at[tile], mask=out_mask,
                                    other=None if out_mask is None else 0)
                ys = finish(list(accs), sum_sq if norm else None, res, k=k, eps=eps,
                            swiglu=swiglu, out_dtype=out_dtype)
                pltr.store(out_refs[0 if swiglu else seg].at[tile], ys[0], mask=out_mask)
                return
            for acc, w in zip(accs, weights):
                pltr.store(out_refs[w].at[(split,) + tile], acc, mask=out_mask)
            if norm:
                @pl.when(j == 0)
                def _():
                    pltr.store(out_refs[num_weights].at[split, pl.ds(0, block_m)], sum_sq,
                               mask=row_ok)


def problem(x, weights, norm_weight, residual, swiglu, config: FusedGemvConfig) -> str | None:
    """What the kernel cannot serve in these operands, or None."""
    if x.ndim != 2:
        return f"needs x [M, K], got {x.shape}"
    if not weights or any(w.ndim != 2 or w.shape[0] != x.shape[1] for w in weights):
        return f"needs weights [K={x.shape[1]}, N], got {[w.shape for w in weights]}"
    for w in weights:  # rows, dtypes, int32 offsets, block sizes: as the plain kernel
        why = operand_problem(x, w, config)
        if why is not None:
            return why
    if swiglu and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        return f"swiglu needs gate and up of one shape, got {[w.shape for w in weights]}"
    if residual is not None and (len(weights) != 1 or residual.shape != (x.shape[0],
                                                                          weights[0].shape[1])):
        return (f"a residual needs one weight and shape [M, N], got {residual.shape} for "
                f"{[w.shape for w in weights]}")
    if norm_weight is not None and norm_weight.shape != (x.shape[1],):
        return f"norm weight {norm_weight.shape} for K={x.shape[1]}"
    return None


def _segments(widths, swiglu, block_n):
    """(first strip, weight indices, N) per output group, and the total strips."""
    groups = [((0, 1), widths[0])] if swiglu else [((i,), n) for i, n in enumerate(widths)]
    segments, first = [], 0
    for weights, n in groups:
        segments.append((first, weights, n))
        first += common.cdiv(n, block_n)
    return tuple(segments), first


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "out_dtype", "config",
                                             "interpret"))
def fused_gemv_pallas(x, weights, norm_weight=None, residual=None, *, eps: float = 1e-6,
                      swiglu: bool = False, out_dtype=None,
                      config: FusedGemvConfig | None = None, interpret: bool = False):
    """x [M, K] times each of `weights` ([K, N_i]) -> a tuple of outputs in out_dtype (default
    x.dtype): x @ w_i each, or with swiglu=True (weights = (gate, up)) the one output
    silu(x @ gate) * (x @ up); norm_weight [K]: RMSNorm x first (eps); residual [M, N] (one
    weight): residual + x @ w. float32 accumulation."""
    weights = tuple(weights)
    m, k = x.shape
    widths = [w.shape[1] for w in weights]
    if config is None:
        config = tuned_fused_config(table_key(
            m, k, widths, norm=norm_weight is not None, residual=residual is not None,
            swiglu=swiglu, dtype=x.dtype))
    if config is None:
        config = fused_config(k, _segments(widths, swiglu, 128)[1])
    why = problem(x, weights, norm_weight, residual, swiglu, config)
    if why is not None:
        raise NotImplementedError(f"fused GEMV kernel: {why}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    norm = norm_weight is not None
    segments, strips = _segments(widths, swiglu, config.block_n)
    k_blocks = common.cdiv(k, config.block_k)
    want = config.num_splits or fused_config(k, strips, block_n=config.block_n).num_splits
    chunk = common.cdiv(k_blocks, min(want, k_blocks)) * config.block_k
    splits = common.cdiv(k, chunk)
    block_m = max(16, common.next_pow2(m))
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, segments=segments, num_weights=len(weights), m=m, k=k, block_m=block_m,
        block_k=config.block_k, block_n=config.block_n, chunk=chunk, splits=splits, norm=norm,
        swiglu=swiglu, residual=residual is not None, eps=eps, precision=precision,
        interpret=interpret, out_dtype=out_dtype)
    if splits == 1:
        shapes = [(m, widths[0])] if swiglu else [(m, n) for n in widths]
        out_shape = [jax.ShapeDtypeStruct(s, out_dtype) for s in shapes]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, m, n), jnp.float32) for n in widths]
        if norm:
            out_shape.append(jax.ShapeDtypeStruct((splits, m), jnp.float32))
    inputs = [x] + ([norm_weight] if norm else []) + list(weights) + (
        [residual] if residual is not None else [])
    outs = pl.pallas_call(
        kernel,
        grid=(strips, splits),
        in_specs=[whole_block(a.shape) for a in inputs],
        out_specs=[whole_block(s.shape) for s in out_shape],
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=config.num_warps,
                                            num_stages=config.num_stages),
        interpret=interpret,
        name="fused_gemv",
    )(*inputs)
    if splits == 1:
        return tuple(outs)
    accs = [jnp.sum(p, axis=0) for p in outs[:len(weights)]]
    sum_sq = jnp.sum(outs[-1], axis=0) if norm else None
    if not swiglu and residual is None:
        return tuple(finish([a], sum_sq, None, k=k, eps=eps, swiglu=False,
                            out_dtype=out_dtype)[0] for a in accs)
    return tuple(finish(accs, sum_sq, residual, k=k, eps=eps, swiglu=swiglu,
                        out_dtype=out_dtype))


def fused_gemv_reference(x, weights, norm_weight=None, residual=None, *, eps: float = 1e-6,
                         swiglu: bool = False, out_dtype=None):
    """What the unfused model computes (`layers.rms_norm`, `project`, `swiglu`, `x + h`)."""
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if norm_weight is not None:
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        x = (x32 * norm_weight.astype(jnp.float32)).astype(x.dtype)
    ys = [jnp.dot(x, w, preferred_element_type=out_dtype) for w in weights]
    if swiglu:
        ys = [(jax.nn.silu(ys[0]) * ys[1]).astype(out_dtype)]
    if residual is not None:
        ys = [(residual + ys[0]).astype(out_dtype)]
    return tuple(ys)
