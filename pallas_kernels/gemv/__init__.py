"""Weight-streaming matmul for few rows (decode projections): x [M, K] @ w [K, N], M <= 32.

Implementations: `xla` (jnp.dot) and `pallas` (split-K, Triton lowering, any NVIDIA GPU);
`small_m_matmul(..., impl="auto")` picks one for the device and falls back to XLA."""

from pallas_kernels.gemv.api import small_m_matmul

__all__ = ["small_m_matmul"]
