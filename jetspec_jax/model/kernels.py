"""Which kernels the model runs: one frozen, hashable value passed to jit as a static argument.

Each choice is an ordered list of implementation names; the first that serves a call runs,
one that cannot serve it raises NotImplementedError and the next serves
(`pallas_kernels.dispatch`, the one resolver).

attention (the cache attention of every layer and of the draft head):
  "fused_decode"  one-token steps of the target through the fused decode kernel (q/k norm,
                  RoPE, cache write and attention in one; dense caches only); every other
                  call takes the rest of the list.
  "decode"        the split-K decode kernel (one query per sequence only; reads paged
                  caches in place, `pallas_kernels.paged`).
  "hopper"        the Pallas Mosaic GPU tree-attention kernel (sm_90; dense caches only).
  "portable"      the Pallas tree-attention kernel, Triton lowering (any NVIDIA GPU; reads
                  paged caches in place).
  "reference"     the pure-JAX reference (XLA); serves every call, the only one off GPUs.
matmul (dense projections and MoE experts, `layers.project` / `layers.moe`):
  "pallas"        the kernels of `pallas_kernels.gemv` (few rows only).
  "tuned"         dense: the kernel for shapes in this device's tuned table only; MoE: as
                  "pallas" (no table exists for the grouped kernels).
  "xla"           einsums and `lax.ragged_dot`; serves every call.
interpret: run the chosen Pallas kernels in interpret mode (CPU tests).

`choose` turns the names users type ("auto", one name, or a comma-separated list) into these
lists, once, for the model and the machine.
"""

from __future__ import annotations

import dataclasses

import jax

from jetspec_jax.options import ATTENTION_KERNELS as ATTENTION  # jax-free: the CLI reads them
from jetspec_jax.options import MATMUL_KERNELS as MATMUL
from jetspec_jax.options import check_kernel_name, kernel_names
from pallas_kernels import dispatch

# "auto" on one GPU, fastest first: the fused kernel for one-token steps, then the chain of
# `pallas_kernels.tree_attention` (each declines what it cannot serve), the reference last.
GPU_ATTENTION = ("fused_decode", "decode", "hopper", "portable", "reference")
# A user's single matmul name: the kernel where it serves, XLA elsewhere.
MATMUL_LISTS = {"pallas": ("pallas", "xla"), "tuned": ("tuned", "xla"), "xla": ("xla",)}


@dataclasses.dataclass(frozen=True)
class Kernels:
    attention: tuple[str, ...] = ("reference",)
    matmul: tuple[str, ...] = ("xla",)
    interpret: bool = False

    def __post_init__(self):  # a single name is a list of one
        object.__setattr__(self, "attention", dispatch.check("attention", self.attention,
                                                             ATTENTION))
        object.__setattr__(self, "matmul", dispatch.check("matmul", self.matmul, MATMUL))
        if not self.cache_attention():
            raise ValueError("fused_decode serves one-token steps only: name the kernels for "
                             "the other calls after it, e.g. ('fused_decode', 'reference')")

    @property
    def attention_name(self) -> str:
        """The preferred attention kernel (the list's first): what results record."""
        return self.attention[0]

    def cache_attention(self) -> tuple[str, ...]:
        """The names for `pallas_kernels.tree_attention.cache_attention`: "fused_decode" is
        the target's own one-token step (`target.attend`), not a cache attention."""
        return tuple(n for n in self.attention if n != "fused_decode")

    def grouped_matmul(self) -> tuple[str, ...]:
        """The names for the grouped MoE matmuls, which have no tuned table: "tuned" runs the
        kernel where it serves (the expert gather it replaces is the slow part)."""
        return tuple(dict.fromkeys("pallas" if n == "tuned" else n for n in self.matmul))


def choose(attention: str = "auto", matmul: str = "auto", *, moe: bool = False,
           sharded: bool = False, backend: str | None = None) -> Kernels:
    """The kernels for a model (moe: it has experts) on this machine. attention, matmul:
    "auto", a name, or a comma-separated list of names (tried in order).

    attention "auto": `GPU_ATTENTION` on a GPU (the fused kernel measured faster per Qwen3-8B
    token on the H200, docs/benchmarks.md), "reference" elsewhere and on a mesh of several
    devices (GSPMD splits XLA attention by head, not the kernels' custom calls:
    docs/sharding.md); "fused_decode" alone means `GPU_ATTENTION`. matmul "auto": "pallas" for
    MoE models (the grouped kernels read the chosen experts in place), "xla" for dense ones
    (faster than the kernels there); a single name is `MATMUL_LISTS`'s list. Raises
    ValueError, naming the choices, for an unknown name and for a GPU kernel without a GPU."""
    backend = jax.default_backend() if backend is None else backend
    check_kernel_name("attention", attention, ("auto", *ATTENTION))
    check_kernel_name("matmul", matmul, ("auto", *MATMUL))
    names = kernel_names(attention)
    if names == ("auto",):
        names = GPU_ATTENTION if backend == "gpu" else ("reference",)
    elif names == ("fused_decode",):
        names = GPU_ATTENTION
    if backend != "gpu" and names != ("reference",):
        raise ValueError(f"attention kernel {attention!r} needs a GPU; this machine has only "
                         f"{backend.upper()} devices; use reference")
    if sharded and names[0] == "fused_decode":
        names = ("reference",)
    mm = kernel_names(matmul)
    if mm == ("auto",):
        mm = ("pallas" if moe else "xla",)
    return Kernels(names, MATMUL_LISTS[mm[0]] if len(mm) == 1 else mm)
