"""The target's two weight layouts.

"separate" is the layout of `params.target_specs`: q, k, v, gate and up each a leaf. It is what
checkpoints, conversion and sharding know. "fused" concatenates each layer's q, k, v into one
"qkv" leaf [D, (N + 2K) H] and a dense MLP's gate and up into one "gate_up" leaf [D, 2F], so
that a step streams each group in one larger matmul, which is faster on one GPU
(docs/benchmarks.md, "Decode speed").
`io.load.load_target` fuses on one GPU; the model reads either layout.

The layout is part of the weights' type: a plain dict is the separate layout, `FusedParams`
(a dict pytree whose layout is static, so jit compiles each layout once) the fused one.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jetspec_jax.model.config import ModelConfig


class Layout(enum.Enum):
    SEPARATE = "separate"
    FUSED = "fused"


@jax.tree_util.register_pytree_with_keys_class
class FusedParams(dict):
    """A target's weights in the fused layout: a dict of the same keys, marked by its type."""

    layout = Layout.FUSED

    def tree_flatten_with_keys(self):
        keys = tuple(sorted(self))
        return [(jax.tree_util.DictKey(k), self[k]) for k in keys], keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values))


def layout_of(params) -> Layout:
    return getattr(params, "layout", Layout.SEPARATE)


def is_fused(params) -> bool:
    return layout_of(params) is Layout.FUSED


def fuse_projections(params, *, in_place: bool = False):
    """The same weights in the fused layout (a copy of the fused leaves; the others shared).
    Leaves already fused and MoE experts (chosen per token) are left as they are.
    in_place=True rewrites the layer dicts of `params` itself, so that each layer's separate
    leaves can be freed as soon as they are concatenated: peak memory grows by one layer's
    q/k/v/gate/up instead of all of them (for a tree the caller owns, e.g. just loaded)."""
    if is_fused(params):
        return params

    def fuse(p):
        p = p if in_place else dict(p)
        d = p["q"].shape[0]
        p["qkv"] = jnp.concatenate([p.pop(n).reshape(d, -1) for n in ("q", "k", "v")], 1)
        if "router" not in p:
            p["gate_up"] = jnp.concatenate([p.pop("gate"), p.pop("up")], axis=1)
        return p

    return FusedParams({**params, "layers": [fuse(p) for p in params["layers"]]})


def split_projections(params, cfg: ModelConfig):
    """The inverse of `fuse_projections`: the separate layout of `params.target_specs` (a plain
    dict)."""
    def split(p):
        p = dict(p)  # [D, (N + 2K) H] -> [D, N, H], [D, K, H], [D, K, H]
        p["q"], p["k"], p["v"] = split_qkv(p.pop("qkv"), cfg)
        if "router" not in p:
            p["gate"], p["up"] = jnp.split(p.pop("gate_up"), 2, axis=-1)
        return p

    if not is_fused(params):
        return params
    return {**params, "layers": [split(p) for p in params["layers"]]}


def split_qkv(qkv, cfg: ModelConfig):
    """[..., (N + 2K) H] -> q [..., N, H], k, v [..., K, H]: the columns of a fused "qkv"
    weight, or of x @ it."""
    n, kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = jnp.split(qkv, [n * h, (n + kv) * h], axis=-1)
    lead = qkv.shape[:-1]
    return q.reshape(*lead, n, h), k.reshape(*lead, kv, h), v.reshape(*lead, kv, h)
