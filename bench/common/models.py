"""Random-weight models for the speed benches: per-step cost does not depend on the weights'
values, so weights of the real shapes are made on the device instead of loaded; and the bytes
one decode step must read, the denominator of every bandwidth figure."""

from __future__ import annotations

import functools


def random_params(specs, dtype="bfloat16"):
    """Random weights (dtype) made leaf by leaf on the device (one small compiled generator per
    shape; a single jit over a 60 GB tree compiles for minutes, and even SmolLM2's whole
    init took 220 s to compile on the H200 with the compilation cache off)."""
    import jax
    import jax.numpy as jnp

    from jetspec_jax.model.params import is_spec

    @functools.partial(jax.jit, static_argnames=("shape", "ones"))
    def make(key, shape, ones):
        if ones:
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(
        treedef, [make(k, s.shape, s.init == "ones") for s, k in zip(leaves, keys)])


def weight_bytes_per_token(cfg, dtype_bytes=2) -> int:
    """Bytes of weights one decode step must read: every layer's attention and norms, the MLP
    (only the experts_per_token chosen experts for MoE), the final norm and the LM head."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * (n + 2 * k) * h + n * h * d + 2 * d + (2 * h if cfg.qk_norm else 0)
    total = 0
    for layer in range(cfg.num_layers):
        if cfg.layer_is_moe(layer):
            mlp = d * cfg.num_experts + cfg.experts_per_token * 3 * d * cfg.moe_intermediate_size
        else:
            mlp = 3 * d * cfg.intermediate_size
        total += attn + mlp
    total += d + cfg.vocab_size * d + d  # final norm, LM head, one embedding row
    return total * dtype_bytes


def kv_bytes_per_token(cfg, context, dtype_bytes=2) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * context * dtype_bytes
