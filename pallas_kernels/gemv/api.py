"""Picks an implementation of the small-M matmul x [M, K] @ w [K, N] for the device.

impl:
  "auto"    the Pallas kernel on an NVIDIA GPU when M <= 32 and it serves the operands,
            else XLA (CPU: XLA, unless interpret=True: the kernel in interpret mode).
  "xla"     `jnp.dot` (the einsum the model runs without the kernel).
  "pallas"  the Triton-lowered kernel; raises NotImplementedError for operands it cannot
            serve.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.gemv.kernel import MAX_ROWS, small_m_matmul_pallas

IMPLS = ("auto", "xla", "pallas")


def _xla(x, w, out_dtype):
    return jnp.dot(x, w, preferred_element_type=out_dtype)


def _on_nvidia_gpu() -> bool:
    import jax

    platform, _, _ = common.device_info()
    return platform == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower()


def small_m_matmul(x, w, *, impl: str = "auto", interpret: bool = False, config=None,
                   out_dtype=None):
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default x.dtype), float32 accumulation.
    config: a `GemvConfig` for the kernel (None: heuristic from the shapes)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown matmul impl {impl!r}; choose from {IMPLS}")
    if impl == "xla":
        return _xla(x, w, out_dtype)
    if impl == "auto" and not ((interpret or _on_nvidia_gpu()) and x.shape[0] <= MAX_ROWS):
        return _xla(x, w, out_dtype)
    try:
        return small_m_matmul_pallas(x, w, out_dtype=out_dtype, config=config,
                                     interpret=interpret)
    except NotImplementedError:
        if impl == "pallas":
            raise
        return _xla(x, w, out_dtype)
