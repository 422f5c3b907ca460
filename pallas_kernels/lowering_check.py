"""Lowers kernels for a GPU target on a machine without one (CPU-only CI), so that errors of
the Pallas -> Triton / Mosaic GPU lowering show up before a GPU run. Compilation to a cubin
(ptxas, Triton's backend) still happens only on the GPU."""

import contextlib

import jax
from jax._src import mesh as mesh_lib
from jax.sharding import AbstractMesh


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H200"):
    """Makes Pallas GPU lowering see `device_kind` (e.g. "NVIDIA H200", "NVIDIA B200")."""
    # The Mosaic GPU lowering rule is registered lazily; import it so that lowering works
    # without a GPU backend.
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401

    dev = mesh_lib.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        yield


def lower_for_gpu(fn, *args, device_kind: str = "NVIDIA H200", **kwargs) -> str:
    """Returns the StableHLO text of fn(*args, **kwargs) lowered for CUDA."""
    with abstract_gpu(device_kind):
        lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(
            lowering_platforms=("cuda",))
    return lowered.as_text()
