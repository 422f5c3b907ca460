"""Pure-JAX references of the small-M matmuls (dense, grouped by pair) and of the
expert-major grouped matmul, float32 accumulation."""

import jax
import jax.numpy as jnp


def small_m_matmul_reference(x, w, out_dtype=None):
    """x [M, K], w [K, N] -> [M, N] in out_dtype (default x.dtype), accumulated in float32.
    XLA:CPU lacks bf16 x bf16 -> f32 dots, so there the operands are upcast (exact: products
    of 16-bit floats are exact in float32)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if jax.default_backend() == "cpu":
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    y = jnp.dot(x, w, preferred_element_type=jnp.float32,
                precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def grouped_small_m_matmul_reference(x, w, experts, out_dtype=None):
    """x [P, K], w [E, K, N], experts [P] -> [P, N]: y[p] = x[p] @ w[experts[p]], float32
    accumulation (one dense matmul per pair)."""
    return jnp.concatenate([small_m_matmul_reference(x[p:p + 1], w[int(e)], out_dtype)
                            for p, e in enumerate(experts.tolist())])


def grouped_matmul_sorted_reference(x, w, group_sizes, out_dtype=None):
    """x [P, K] (rows sorted by expert), w [E, K, N], group_sizes [E] -> [P, N]:
    `lax.ragged_dot` accumulated in float32 (operands upcast on CPU, as above)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if jax.default_backend() == "cpu":
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    y = jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32,
                           precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)
