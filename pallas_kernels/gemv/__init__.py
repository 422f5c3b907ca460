"""Weight-streaming matmuls for few rows (decode projections): x [M, K] @ w [K, N], M <= 32,
and its grouped form for MoE experts, y[p] = x[p] @ w[experts[p]]; for MoE passes with many
pairs, the expert-major grouped matmul over rows sorted by expert (`grouped_matmul_sorted`,
the contract of `lax.ragged_dot`).

Implementations: `xla`, `pallas` (split-K, Triton lowering, any NVIDIA GPU) and, dense only,
`tuned` (the kernel for the shapes of this device's tuned table, `tuned_<device>.json`); `impl`
is a name or an ordered list (`api.py`), by default the kernel where it serves, else XLA."""

from pallas_kernels.gemv.api import grouped_matmul_sorted, grouped_small_m_matmul, small_m_matmul

__all__ = ["grouped_matmul_sorted", "grouped_small_m_matmul", "small_m_matmul"]
