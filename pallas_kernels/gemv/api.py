"""The small-M matmuls by implementation name: dense x [M, K] @ w [K, N] (`small_m_matmul`)
and grouped y[p] = x[p] @ w[experts[p]] (`grouped_small_m_matmul`, MoE), and the
expert-major grouped matmul for many pairs (`grouped_matmul_sorted`: rows sorted by expert,
the contract of `lax.ragged_dot`).

  "pallas"  the Triton-lowered kernel (NVIDIA GPUs; elsewhere in interpret mode only); it
            declines (NotImplementedError) operands it cannot serve, e.g. more than 32 rows
            for the small-M kernels.
  "tuned"   (dense only) the kernel with this device's tuned config, for shapes with an entry
            in its table (`config.tuned_gemv_config`: where it measured faster than XLA).
  "xla"     the einsum the model runs without the kernel (grouped: gather the experts'
            weights, then a batched matvec; sorted: `lax.ragged_dot`); serves every call.

impl: a name or an ordered list of names (`pallas_kernels.dispatch`); None: `DEFAULT`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import common, dispatch
from pallas_kernels.gemv.config import tuned_gemv_config
from pallas_kernels.gemv.expert_major import grouped_matmul_sorted_pallas
from pallas_kernels.gemv.grouped import grouped_small_m_matmul_pallas
from pallas_kernels.gemv.kernel import small_m_matmul_pallas

DEFAULT = ("pallas", "xla")
Impl = str | Sequence[str] | None


def _require_nvidia(interpret: bool) -> None:
    if interpret:
        return
    platform, _, _ = common.device_info()
    if platform != "gpu" or "nvidia" not in jax.devices()[0].device_kind.lower():
        raise NotImplementedError("the matmul kernels need an NVIDIA GPU (or interpret mode)")


def _kernel(name: str):
    """The kernel `name` of this module as an implementation: declined off NVIDIA GPUs unless
    interpreted. Looked up at each call, so tests may replace it."""
    def run(*args, interpret, **kw):
        _require_nvidia(interpret)
        return globals()[name](*args, interpret=interpret, **kw)
    return run


def _tuned(x, w, *, interpret, config, out_dtype):
    config = config or tuned_gemv_config(x.shape[0], x.shape[1], w.shape[-1], x.dtype)
    if config is None:
        raise NotImplementedError(f"no tuned entry for M={x.shape[0]}, K={x.shape[1]}, "
                                  f"N={w.shape[-1]}, {x.dtype}")
    return _kernel("small_m_matmul_pallas")(x, w, interpret=interpret, config=config,
                                          out_dtype=out_dtype)


def _xla(x, w, *, interpret, config, out_dtype):
    return jnp.dot(x, w, preferred_element_type=out_dtype)


def _xla_grouped(x, w, experts, *, interpret, config, out_dtype):
    return jnp.einsum("PK,PKN->PN", x, w[experts], preferred_element_type=out_dtype)


def _xla_sorted(x_sorted, w, group_sizes, *, interpret, config, out_dtype):
    return jax.lax.ragged_dot(x_sorted, w, group_sizes, preferred_element_type=out_dtype)


DENSE = {"pallas": _kernel("small_m_matmul_pallas"), "tuned": _tuned, "xla": _xla}
GROUPED = {"pallas": _kernel("grouped_small_m_matmul_pallas"), "xla": _xla_grouped}
SORTED = {"pallas": _kernel("grouped_matmul_sorted_pallas"), "xla": _xla_sorted}


def small_m_matmul(x, w, *, impl: Impl = None, interpret: bool = False, config=None,
                   out_dtype=None):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x.dtype), float32 accumulation.
    config: a `GemvConfig` for the kernel (None: heuristic from the shapes, or for "tuned" the
    table's entry)."""
    return dispatch.run("matmul", DEFAULT if impl is None else impl, DENSE, x, w,
                        interpret=interpret, config=config, out_dtype=out_dtype)


def grouped_small_m_matmul(x, w, experts, *, impl: Impl = None, interpret: bool = False,
                           config=None, out_dtype=None):
    """x [P, K], w [E, K, N], experts [P] int32 -> [P, N] with y[p] = x[p] @ w[experts[p]]
    in out_dtype (default x.dtype), float32 accumulation. The kernel reads each chosen
    expert's weights in place; XLA gathers them first (a copy of P x K x N elements)."""
    return dispatch.run("matmul", DEFAULT if impl is None else impl, GROUPED, x, w, experts,
                        interpret=interpret, config=config, out_dtype=out_dtype)


def grouped_matmul_sorted(x_sorted, w, group_sizes, *, impl: Impl = None,
                          interpret: bool = False, config=None, out_dtype=None):
    """x_sorted [P, K] (rows sorted by expert), w [E, K, N], group_sizes [E] int32 (sum P)
    -> [P, N] in out_dtype (default x.dtype), float32 accumulation: the rows of expert e times
    w[e], as `jax.lax.ragged_dot(x_sorted, w, group_sizes)`. The kernel reads each expert
    that has rows once and skips the others; config: a `SortedConfig` (None: heuristic)."""
    return dispatch.run("matmul", DEFAULT if impl is None else impl, SORTED, x_sorted, w,
                        group_sizes, interpret=interpret, config=config, out_dtype=out_dtype)
