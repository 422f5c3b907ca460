"""Data-parallel training: a mesh with one "data" axis; the batch is split over it and the
head, its optimizer state and the target are replicated. The step's code is unchanged: jit
partitions it from its inputs' placement (the gradients are reduced across "data").

    mesh = data_mesh("data=4")
    dparams, tparams = place(mesh, (dparams, tparams))
    batch = place(mesh, batch, batch=True)
"""

from __future__ import annotations

import re

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


def data_parallel(spec: str) -> int:
    """"data=N" -> N; ValueError naming what is wrong."""
    m = re.fullmatch(r"data=(\d+)", str(spec).replace(" ", ""))
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"bad training mesh {spec!r}: expected data=N, N >= 1 devices (the "
                         "batch is split over them, the head replicated)")
    return int(m.group(1))


def data_mesh(spec: str) -> Mesh:
    n, devices = data_parallel(spec), jax.devices()
    if n > len(devices):
        raise ValueError(f"mesh {spec!r} needs {n} devices, {len(devices)} "
                         f"{jax.default_backend()} devices are present")
    # Auto axes: jit propagates the placed inputs' shardings through the unchanged step.
    return jax.make_mesh((n,), ("data",), (AxisType.Auto,), devices=devices[:n])


def place(mesh: Mesh | None, tree, batch: bool = False):
    """Puts a tree on the mesh: split on its first axis over "data" (batch) or replicated."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, P("data") if batch else P()))
