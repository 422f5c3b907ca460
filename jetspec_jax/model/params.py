"""One abstract description of the target's weights drives init, loading and sharding.

Weights are a nested dict pytree:
  {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (untied only),
   "layers": [ {"attn_norm": [D], "q": [D, N, H], "k": [D, K, H], "v": [D, K, H],
                "o": [N, H, D], "q_norm": [H], "k_norm": [H] (qk_norm only), "mlp_norm": [D],
                dense: "gate": [D, F], "up": [D, F], "down": [F, D]
                MoE:   "router": [D, E], "gate": [E, D, F], "up": [E, D, F], "down": [E, F, D]},
               ... one dict per layer ] }
Each leaf is described by a `ParamSpec` (shape, logical axis names, init kind).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jetspec_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, used by sharding rules
    init: str = "normal"  # "normal" (fan-in scaled) or "ones"
    fan_in: int = 1


def _w(shape, axes, fan_in):
    return ParamSpec(tuple(shape), tuple(axes), "normal", fan_in)


def _norm(size, axis="embed"):
    return ParamSpec((size,), (axis,), "ones")


def attention_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    specs = {
        "q": _w((d, n, h), ("embed", "heads", "head_dim"), d),
        "k": _w((d, k, h), ("embed", "kv_heads", "head_dim"), d),
        "v": _w((d, k, h), ("embed", "kv_heads", "head_dim"), d),
        "o": _w((n, h, d), ("heads", "head_dim", "embed"), n * h),
    }
    if cfg.qk_norm:
        specs["q_norm"] = _norm(h, "head_dim")
        specs["k_norm"] = _norm(h, "head_dim")
    return specs


def mlp_specs(cfg: ModelConfig, moe: bool) -> dict[str, ParamSpec]:
    d = cfg.hidden_size
    if moe:
        e, f = cfg.num_experts, cfg.moe_intermediate_size
        return {
            # Not "experts": top-k needs every expert's logit, so the router stays replicated.
            "router": _w((d, e), ("embed", "router_experts"), d),
            "gate": _w((e, d, f), ("experts", "embed", "mlp"), d),
            "up": _w((e, d, f), ("experts", "embed", "mlp"), d),
            "down": _w((e, f, d), ("experts", "mlp", "embed"), f),
        }
    f = cfg.intermediate_size
    return {
        "gate": _w((d, f), ("embed", "mlp"), d),
        "up": _w((d, f), ("embed", "mlp"), d),
        "down": _w((f, d), ("mlp", "embed"), f),
    }


def layer_specs(cfg: ModelConfig, layer: int) -> dict[str, ParamSpec]:
    return {
        "attn_norm": _norm(cfg.hidden_size),
        **attention_specs(cfg),
        "mlp_norm": _norm(cfg.hidden_size),
        **mlp_specs(cfg, cfg.layer_is_moe(layer)),
    }


def target_specs(cfg: ModelConfig) -> dict:
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = {
        "embed": ParamSpec((v, d), ("vocab", "embed"), "normal", 1),
        "layers": [layer_specs(cfg, i) for i in range(cfg.num_layers)],
        "final_norm": _norm(d),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = _w((d, v), ("embed", "vocab"), d)
    return specs


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(specs, dtype=jnp.bfloat16):
    """ShapeDtypeStructs for every leaf: what `jax.eval_shape`-style code and loaders check against."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)


def init_params(specs, key, dtype=jnp.float32, scale: float = 1.0):
    """Random weights: normal with std scale/sqrt(fan_in); norms are ones."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(spec, k):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        std = scale / math.sqrt(spec.fan_in)
        return (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


def flatten_params(tree) -> dict:
    """{"layers/0/q": leaf, ...}: the leaves (or ParamSpecs) by their "/"-joined tree path, the
    one key form of every reader (`unflatten`, the conversion rules, the shard files' keys)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    return {"/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path): leaf
            for path, leaf in flat}


def unflatten(flat: dict, specs, what: str = "checkpoint", dtype=None, *,
              absent=frozenset()):
    """{"/"-path: array} -> the tree of `specs` (ParamSpecs or arrays) holding those arrays
    (cast to dtype if given); first one ValueError listing every missing, unexpected or
    mis-shaped tensor (`check_params`). absent: paths that may be missing (None in the tree;
    a converter that skips a tensor on purpose)."""
    want = flatten_params(specs)
    _check_flat(flat, {k: s for k, s in want.items() if k in flat or k not in absent}, what)
    treedef = jax.tree.structure(specs, is_leaf=is_spec)
    return jax.tree.unflatten(treedef, [jnp.asarray(flat[k], dtype) if k in flat else None
                                        for k in want])


def check_params(params, specs, what: str = "checkpoint") -> None:
    """Raises one ValueError that lists every missing, extra or mis-shaped tensor."""
    _check_flat(flatten_params(params), flatten_params(specs), what)


def _check_flat(flat_params: dict, flat_specs: dict, what: str) -> None:
    missing = sorted(set(flat_specs) - set(flat_params))
    extra = sorted(set(flat_params) - set(flat_specs))
    shapes = [
        f"{name}: expected {tuple(flat_specs[name].shape)}, got {tuple(flat_params[name].shape)}"
        for name in sorted(set(flat_specs) & set(flat_params))
        if tuple(flat_params[name].shape) != tuple(flat_specs[name].shape)
    ]
    problems = (
        [f"missing tensor {m}" for m in missing]
        + [f"unexpected tensor {e}" for e in extra]
        + [f"shape mismatch {s}" for s in shapes]
    )
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"{what} does not match the model config:\n  {shown}{more}")

