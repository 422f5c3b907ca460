"""Which kernels the model runs: one frozen, hashable value passed to jit as a static argument.

attention (the cache attention of every layer and of the draft head):
  "reference"     the pure-JAX reference (XLA); the only one off GPUs.
  "portable"      the Pallas tree-attention kernel, Triton lowering (any NVIDIA GPU).
  "hopper"        the Pallas Mosaic GPU tree-attention kernel (sm_90).
  "decode"        the split-K decode kernel (one query per sequence only).
  "fused_decode"  one-token steps through the fused decode kernel (q/k norm, RoPE, cache write
                  and attention in one), every other call through the device's kernel chain
                  (`pallas_kernels.tree_attention.cache_attention(impl="auto")`).
matmul (dense projections and MoE experts, `layers.project` / `layers.moe`):
  "xla"           einsums and `lax.ragged_dot`.
  "pallas"        the kernels of `pallas_kernels.gemv` where they serve, XLA elsewhere.
  "tuned"         dense: the kernel only for shapes in this device's tuned table; MoE as "pallas".
interpret: run the chosen Pallas kernels in interpret mode (CPU tests).

`choose` resolves "auto" once, for the model and the machine.
"""

from __future__ import annotations

import dataclasses

import jax

from jetspec_jax.options import ATTENTION_KERNELS as ATTENTION  # jax-free: the CLI reads them
from jetspec_jax.options import MATMUL_KERNELS as MATMUL
from jetspec_jax.options import check_kernel_name


@dataclasses.dataclass(frozen=True)
class Kernels:
    attention: str = "reference"
    matmul: str = "xla"
    interpret: bool = False

    def __post_init__(self):
        check_kernel_name("attention", self.attention, ATTENTION)
        check_kernel_name("matmul", self.matmul, MATMUL)

    def cache_attention(self) -> tuple[str, bool]:
        """(impl, interpret) for `pallas_kernels.tree_attention.cache_attention`. The fused
        decode kernel serves one-token steps only (the model tries it first); what it does not
        serve takes the device's chain."""
        if self.attention == "fused_decode":
            return "auto", False
        return self.attention, self.interpret and self.attention != "reference"


def choose(attention: str = "auto", matmul: str = "auto", *, moe: bool = False,
           sharded: bool = False, backend: str | None = None) -> Kernels:
    """The kernels for a model (moe: it has experts) on this machine, "auto" resolved:
    attention "fused_decode" on a GPU (measured faster per Qwen3-8B token on the H200,
    docs/benchmarks.md), "reference" elsewhere and on a mesh of several devices (GSPMD splits
    XLA attention by head, not the kernels' custom calls: docs/sharding.md); matmul "pallas"
    for MoE models (the grouped kernels read the chosen experts in place), "xla" for dense
    ones (faster than the kernels there). Raises ValueError, naming the choices, for an
    unknown name and for a GPU kernel without a GPU."""
    backend = jax.default_backend() if backend is None else backend
    check_kernel_name("attention", attention, ("auto", *ATTENTION))
    check_kernel_name("matmul", matmul, ("auto", *MATMUL))
    if attention == "auto":
        attention = "fused_decode" if backend == "gpu" else "reference"
    elif attention != "reference" and backend != "gpu":
        raise ValueError(f"attention kernel {attention!r} needs a GPU; this machine has only "
                         f"{backend.upper()} devices; use reference")
    if sharded and attention == "fused_decode":
        attention = "reference"
    if matmul == "auto":
        matmul = "pallas" if moe else "xla"
    return Kernels(attention, matmul)
