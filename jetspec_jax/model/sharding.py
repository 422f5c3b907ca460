"""Tensor and expert parallel decoding: a device mesh, rules from logical axes to mesh axes, and
the shardings of weights, KV caches and the speculative state.

A mesh spec names its axes: "tp=2", "tp=4,ep=2", or "1" (one device, nothing sharded).
  tp  tensor parallel: attention heads (N, and K for the caches), MLP width F, vocab V
  ep  expert parallel: the experts E of MoE layers
A dimension is sharded only when the mesh axis divides it; otherwise it is replicated
(`replicated_dims` says which): e.g. Qwen3-30B-A3B's 4 KV heads on tp=8. Everything else
(model width D, head dim H, norms, the router, batch, cache slots) is replicated, so the
model's own code runs unchanged: jit propagates these input shardings through the einsums
(GSPMD: column-parallel q/k/v and gate/up, an all-reduce after o and down, a vocab-parallel LM
head), and `constrain_state` pins the KV caches in the decoding loops' carries.

Inside jit the mesh comes from the context (`use(mesh)`, i.e. `jax.set_mesh`); without one every
constraint is a no-op and the single-device program is exactly what it was.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jetspec_jax.model.cache import KV_AXES, LENGTHS_AXES, POOL_AXES, KVCache
from jetspec_jax.model.params import is_spec

MESH_AXES = ("tp", "ep")
RULES = {"heads": "tp", "kv_heads": "tp", "mlp": "tp", "vocab": "tp", "experts": "ep"}


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"tp=4,ep=2" -> {"tp": 4, "ep": 2}; "1" -> {"tp": 1}. ValueError naming what is wrong."""
    text = str(spec).replace(" ", "")
    if text == "1":
        return {"tp": 1}
    sizes = {}
    for part in text.split(","):
        m = re.fullmatch(r"([A-Za-z_]\w*)=(\d+)", part)
        if m is None:
            raise ValueError(f"bad mesh spec {spec!r}: {part!r} is not NAME=SIZE (e.g. "
                             "'tp=2', 'tp=4,ep=2', or '1' for one device)")
        name, size = m.group(1), int(m.group(2))
        if name not in MESH_AXES:
            raise ValueError(f"bad mesh spec {spec!r}: unknown axis {name!r}; known axes: "
                             f"{', '.join(MESH_AXES)} (tensor, expert parallel)")
        if name in sizes:
            raise ValueError(f"bad mesh spec {spec!r}: axis {name!r} given twice")
        if size < 1:
            raise ValueError(f"bad mesh spec {spec!r}: axis {name!r} has size {size}, need >= 1")
        sizes[name] = size
    return sizes


def make_mesh(spec: str, devices: Sequence | None = None) -> Mesh:
    """A mesh over `devices` (default: every device; "1": the first one), whose count must
    equal the product of the spec's axis sizes. Axes are Auto: jit propagates shardings."""
    sizes = parse_mesh_spec(spec)
    n = math.prod(sizes.values())
    if devices is None:
        devices = jax.devices()[:1] if str(spec).strip() == "1" else jax.devices()
    if n != len(devices):
        raise ValueError(
            f"mesh {spec!r} needs {n} devices but {len(devices)} are given ({len(jax.devices())} "
            f"{jax.default_backend()} devices present); make the axis sizes multiply to the "
            "device count, or limit the devices (e.g. CUDA_VISIBLE_DEVICES)")
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), (AxisType.Auto,) * len(sizes),
                         devices=list(devices))


def abstract_mesh(spec: str) -> AbstractMesh:
    """The mesh's shape without devices: for shard shapes in dry runs."""
    sizes = parse_mesh_spec(spec)
    return AbstractMesh(tuple(sizes.values()), tuple(sizes), (AxisType.Auto,) * len(sizes))


def as_mesh(mesh) -> Mesh | None:
    """None, a spec string or a Mesh -> a Mesh or None (the API's `mesh=` arguments)."""
    return make_mesh(mesh) if isinstance(mesh, str) else mesh


def use(mesh):
    """Context in which jit traces with `mesh` (no-op for None)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


# ---- logical axes -> partition specs ----------------------------------------------------------


def logical_spec(axes: Sequence[str | None], shape: Sequence[int],
                 mesh_shape: Mapping[str, int], rules: Mapping[str, str] = RULES
                 ) -> PartitionSpec:
    """Each dim goes to its rule's mesh axis if that axis has size > 1, divides the dim and is
    not used by an earlier dim; else it is replicated (None)."""
    out = []
    for axis, dim in zip(axes, shape, strict=True):
        target = rules.get(axis)
        size = mesh_shape.get(target, 1)
        out.append(target if size > 1 and dim % size == 0 and target not in out else None)
    return PartitionSpec(*out)


def replicated_dims(specs, mesh_shape: Mapping[str, int], rules=RULES) -> list[str]:
    """Logical axes a rule would shard but the mesh axis does not divide, e.g.
    "kv_heads=4 not divisible by tp=8: replicated" (one line per distinct case)."""
    notes = set()
    for spec in jax.tree.leaves(specs, is_leaf=is_spec):
        for axis, dim in zip(spec.axes, spec.shape):
            size = mesh_shape.get(rules.get(axis), 1)
            if size > 1 and dim % size:
                notes.add(f"{axis}={dim} not divisible by {rules[axis]}={size}: replicated")
    return sorted(notes)


def param_shardings(specs, mesh):
    """ParamSpec tree -> NamedSharding tree (mesh may be abstract, for shard shapes)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_spec(s.axes, s.shape, mesh.shape)),
                        specs, is_leaf=is_spec)


def shard_params(params, specs, mesh):
    """Places (or reshards) a weights tree onto the mesh; each device receives only its part."""
    return jax.device_put(params, param_shardings(specs, mesh))


def replicate(tree, mesh):
    """Small inputs (prompts, lengths, keys) replicated on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


# ---- caches and decoding state -----------------------------------------------------------------


def _is_cache(x) -> bool:
    return isinstance(x, KVCache)


def state_specs(tree, mesh_shape: Mapping[str, int]):
    """PartitionSpecs for a decoding state (a KVCache, SpecState, or any pytree holding them):
    K/V [B, K, S, H] (paged: the pools) shard K over tp; every other leaf (lengths, block
    tables, tokens, taps, keys) is small and replicated."""

    def one(x):
        if not _is_cache(x):
            return PartitionSpec()
        axes = KV_AXES if x.table is None else POOL_AXES
        kv = lambda a: logical_spec(axes, a.shape, mesh_shape)  # noqa: E731
        return KVCache(k=[kv(a) for a in x.k], v=[kv(a) for a in x.v],
                       lengths=logical_spec(LENGTHS_AXES, x.lengths.shape, mesh_shape),
                       table=None if x.table is None else PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=_is_cache)


def state_shardings(tree, mesh):
    """NamedShardings of a decoding state (concrete or `jax.eval_shape` abstract)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(tree, mesh.shape))


def constrain_state(tree):
    """Inside jit: pins a decoding state to `state_specs` on the context mesh, so loop carries
    keep their caches sharded by KV head. No-op without a context mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    return jax.lax.with_sharding_constraint(tree, state_specs(tree, mesh.shape))
