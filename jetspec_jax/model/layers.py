"""Building blocks shared by the target model and the draft head."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jetspec_jax.model.kernels import Kernels
from pallas_kernels.gemv import grouped_matmul_sorted, grouped_small_m_matmul, small_m_matmul


def rms_norm(x, weight, eps):
    """RMSNorm computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta):
    """Rotary embedding, half-split layout (HF `rotate_half`). x [B, T, heads, H], positions [B, T]."""
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


XLA = Kernels()


def project(eq, x, w, kernels: Kernels = XLA, out_dtype=None):
    """A dense projection `einsum(eq, x, w)` whose contracted axes are x's last and w's first
    (e.g. "BTNH,NHD->BTD"), run as x [M, K] @ w [K, N]: by XLA, or with kernels.matmul other
    than "xla" through `pallas_kernels.gemv`, by the first of its names that serves. The 2-D
    form matters on the CPU: given the einsum, XLA there may pick a layout that transposes the
    whole weight (o's [N, H, D]) at every step of a decoding loop."""
    x_axes, rest = eq.split(",")
    w_axes, out_axes = rest.split("->")
    c = len(set(x_axes) & set(w_axes))
    if x_axes[-c:] != w_axes[:c] or out_axes != x_axes[:-c] + w_axes[c:]:
        raise ValueError(f"project: {eq} is not x's trailing axes against w's leading ones")
    lead, tail = x.shape[:-c], w.shape[c:]
    x2, w2 = x.reshape(math.prod(lead), -1), w.reshape(-1, math.prod(tail))
    if kernels.matmul == ("xla",):
        y = jnp.dot(x2, w2, preferred_element_type=out_dtype)
    else:
        y = small_m_matmul(x2, w2, impl=kernels.matmul, interpret=kernels.interpret,
                           out_dtype=out_dtype)
    return y.reshape(lead + tail)


def swiglu(x, gate, up, down, kernels: Kernels = XLA):
    """x [B, T, D]; gate, up [D, F]; down [F, D]."""
    h = jax.nn.silu(project("BTD,DF->BTF", x, gate, kernels)) * project(
        "BTD,DF->BTF", x, up, kernels)
    return project("BTF,FD->BTD", h, down, kernels)


def moe(x, router, gate, up, down, *, top_k, normalize, kernels: Kernels = XLA):
    """Qwen3-MoE block. x [B, T, D]; router [D, E]; gate, up [E, D, F]; down [E, F, D].

    With few (token, expert) pairs (at most E/2: batch-1 decode) each pair multiplies its
    expert's weights directly: matmul "xla" gathers them (XLA copies the gathered
    weights), any other the grouped Pallas kernel reads them in place (where it serves;
    "tuned" too: the gather it replaces is the slow part). With more pairs (verify, prefill)
    tokens are sorted by expert and run through grouped matmuls over the sorted rows: "xla"
    `lax.ragged_dot`, any other the expert-major Pallas kernel (`grouped_matmul_sorted`, on
    NVIDIA GPUs), which reads each expert with rows once and skips the others.
    """
    b, t, d = x.shape
    num_experts = router.shape[-1]
    tokens = x.reshape(b * t, d)  # [BT, D]
    probs = jax.nn.softmax(
        jnp.einsum("MD,DE->ME", tokens, router, preferred_element_type=jnp.float32), axis=-1
    )
    weights, experts = jax.lax.top_k(probs, top_k)  # [BT, k]
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    pair_weight = weights.reshape(-1).astype(jnp.float32)  # [BT*k]
    flat_experts = experts.reshape(-1)  # [BT*k]
    if flat_experts.shape[0] <= num_experts // 2:
        # Few (token, expert) pairs, as in batch-1 decoding: read only the chosen experts.
        pair_x = jnp.repeat(tokens, top_k, axis=0)  # [P = BT*k, D]
        mm = functools.partial(grouped_small_m_matmul, experts=flat_experts,
                               impl=kernels.grouped_matmul(), interpret=kernels.interpret)
        h = jax.nn.silu(mm(pair_x, gate)) * mm(pair_x, up)  # [P, F]
        out = mm(h, down).astype(jnp.float32)  # [P, D]
        combined = (out * pair_weight[:, None]).reshape(b * t, top_k, d).sum(axis=1)
        return combined.astype(x.dtype).reshape(b, t, d)
    order = jnp.argsort(flat_experts, stable=True)
    token_of_pair = order // top_k
    sorted_x = tokens[token_of_pair]  # [BT*k, D]
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    mm = functools.partial(grouped_matmul_sorted, group_sizes=group_sizes,
                           impl=kernels.grouped_matmul(), interpret=kernels.interpret)
    h = jax.nn.silu(mm(sorted_x, gate)) * mm(sorted_x, up)  # [BT*k, F]
    out_sorted = mm(h, down)  # [BT*k, D]
    combined = jnp.zeros((b * t, d), jnp.float32).at[token_of_pair].add(
        out_sorted.astype(jnp.float32) * pair_weight[order][:, None]
    )
    return combined.astype(x.dtype).reshape(b, t, d)


def exact_top_k(x, k: int, group: int = 128):
    """`jax.lax.top_k` over the last axis (values, int32 ids), in two small selections where
    the axis splits into many groups: the K groups with the largest maxima hold the K largest
    entries (an entry outside them has K larger ones, one in each), so top_k over those groups'
    K x group entries is exact, and no selection runs over the whole vocabulary."""
    v = x.shape[-1]
    if v % group or v // group < 4 * k:
        top, ids = jax.lax.top_k(x, k)
        return top, ids.astype(jnp.int32)
    grouped = x.reshape(*x.shape[:-1], v // group, group)
    _, best = jax.lax.top_k(grouped.max(-1), k)  # [..., K] group ids
    best = jnp.sort(best, axis=-1)  # candidates in id order: ties go to the lower id, as top_k's
    cand = jnp.take_along_axis(grouped, best[..., None], axis=-2)  # [..., K, group]
    top, at = jax.lax.top_k(cand.reshape(*x.shape[:-1], k * group), k)
    ids = jnp.take_along_axis(best, at // group, axis=-1) * group + at % group
    return top, ids.astype(jnp.int32)
