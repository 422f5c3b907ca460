"""Picks an implementation of the small-M matmuls for the device: dense x [M, K] @ w [K, N]
(`small_m_matmul`) and grouped y[p] = x[p] @ w[experts[p]] (`grouped_small_m_matmul`, MoE),
and of the expert-major grouped matmul for many pairs (`grouped_matmul_sorted`: rows sorted
by expert, the contract of `lax.ragged_dot`).

impl:
  "auto"    the Pallas kernel on an NVIDIA GPU when M <= 32 (sorted: any row count) and it
            serves the operands, else XLA (CPU: XLA, unless interpret=True: the kernel in
            interpret mode).
  "tuned"   (dense only) as "auto", but only for shapes with an entry in this device's table
            (`config.tuned_gemv_config`: where the kernel measured faster than XLA), with that
            entry's config; XLA for every other shape and off-GPU.
  "xla"     the einsum the model runs without the kernel (grouped: gather the experts'
            weights, then a batched matvec; sorted: `lax.ragged_dot`).
  "pallas"  the Triton-lowered kernel; raises NotImplementedError for operands it cannot
            serve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.gemv.config import tuned_gemv_config
from pallas_kernels.gemv.expert_major import grouped_matmul_sorted_pallas
from pallas_kernels.gemv.grouped import grouped_small_m_matmul_pallas
from pallas_kernels.gemv.kernel import MAX_ROWS, small_m_matmul_pallas

IMPLS = ("auto", "tuned", "xla", "pallas")
GROUPED_IMPLS = ("auto", "xla", "pallas")


def _xla(x, w, out_dtype):
    return jnp.dot(x, w, preferred_element_type=out_dtype)


def _xla_grouped(x, w, experts, out_dtype):
    return jnp.einsum("PK,PKN->PN", x, w[experts], preferred_element_type=out_dtype)


def _on_nvidia_gpu() -> bool:
    platform, _, _ = common.device_info()
    return platform == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower()


def _dispatch(impl, impls, rows_ok, kernel, xla, interpret):
    """Runs `kernel()` or `xla()` as impl says, falling back to XLA where the kernel raises
    NotImplementedError (except for impl="pallas"). rows_ok: the row count suits the kernel
    (for "auto")."""
    if impl not in impls:
        raise ValueError(f"unknown matmul impl {impl!r}; choose from {impls}")
    if impl == "xla" or (impl != "pallas" and not ((interpret or _on_nvidia_gpu())
                                                    and rows_ok)):
        return xla()
    try:
        return kernel()
    except NotImplementedError:
        if impl == "pallas":
            raise
        return xla()


def small_m_matmul(x, w, *, impl: str = "auto", interpret: bool = False, config=None,
                   out_dtype=None):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x.dtype), float32 accumulation.
    config: a `GemvConfig` for the kernel (None: heuristic from the shapes, or for "tuned" the
    table's entry)."""
    if impl == "tuned" and config is None:
        config = tuned_gemv_config(x.shape[0], x.shape[1], w.shape[-1], x.dtype)
        if config is None:
            impl = "xla"
    return _dispatch(
        impl, IMPLS, x.shape[0] <= MAX_ROWS,
        lambda: small_m_matmul_pallas(x, w, out_dtype=out_dtype, config=config,
                                      interpret=interpret),
        lambda: _xla(x, w, out_dtype), interpret)


def grouped_small_m_matmul(x, w, experts, *, impl: str = "auto", interpret: bool = False,
                           config=None, out_dtype=None):
    """x [P, K], w [E, K, N], experts [P] int32 -> [P, N] with y[p] = x[p] @ w[experts[p]]
    in out_dtype (default x.dtype), float32 accumulation. The kernel reads each chosen
    expert's weights in place; XLA gathers them first (a copy of P x K x N elements)."""
    return _dispatch(
        impl, GROUPED_IMPLS, x.shape[0] <= MAX_ROWS,
        lambda: grouped_small_m_matmul_pallas(x, w, experts, out_dtype=out_dtype,
                                              config=config, interpret=interpret),
        lambda: _xla_grouped(x, w, experts, out_dtype), interpret)


def grouped_matmul_sorted(x_sorted, w, group_sizes, *, impl: str = "auto",
                          interpret: bool = False, config=None, out_dtype=None):
    """x_sorted [P, K] (rows sorted by expert), w [E, K, N], group_sizes [E] int32 (sum P)
    -> [P, N] in out_dtype (default x.dtype), float32 accumulation: the rows of expert e times
    w[e], as `jax.lax.ragged_dot(x_sorted, w, group_sizes)`. The kernel reads each expert
    that has rows once and skips the others; config: a `SortedConfig` (None: heuristic)."""
    return _dispatch(
        impl, GROUPED_IMPLS, True,
        lambda: grouped_matmul_sorted_pallas(x_sorted, w, group_sizes, out_dtype=out_dtype,
                                             config=config, interpret=interpret),
        lambda: jax.lax.ragged_dot(x_sorted, w, group_sizes, preferred_element_type=out_dtype),
        interpret)
