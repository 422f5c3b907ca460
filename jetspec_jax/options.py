"""Option values and their ranges, importable without JAX: the CLI builds its flag tables and
checks every number from here before anything heavy is imported; the decoders import the same
constants."""

from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m"
DTYPE_NAMES = ("bfloat16", "float32")
TREE_METHODS = ("accum_logp", "top2gap", "chain")
MAX_BUDGET = 1024  # tree nodes verified per round at most
PREFILL_CHUNK = 256  # prompt tokens per prefill pass
NGRAM_DRAFT = "ngram"  # --draft: prompt-lookup drafting (draft/ngram.py), no head
NGRAM_LEN = 8  # its chain's length unless --ngram says otherwise
GPU_BUCKETS = (16, 32, 64, 128, 256)  # tree sizes budget="auto" picks from on a GPU
CPU_BUCKETS = (4, 8, 16, 32)  # on a CPU, where verifying costs nearly linearly in nodes
ATTENTION_KERNELS = ("reference", "portable", "hopper", "decode", "fused_decode")
MATMUL_KERNELS = ("xla", "pallas", "tuned")
ATTN_IMPLS = ("auto", *ATTENTION_KERNELS)  # what --attn-impl takes (`model.kernels.choose`)


def check_kernel_name(kind: str, name: str, names: tuple[str, ...]) -> None:
    """A kernel name among `names` ("attention" or "matmul" kernels), else one line naming
    the choices."""
    if name not in names:
        raise ValueError(f"unknown {kind} kernel {name!r}; choose from {', '.join(names)}")


def decoding_problems(*, max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0,
                      prefill_chunk=PREFILL_CHUNK) -> list[str]:
    """Every decoding number out of its range, one message each (empty: all fine); the tree's
    own (budget, width) are `draft.tree_spec.TreeSpec.problems`."""
    problems = []
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        problems.append(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        problems.append(f"top_k must be >= 0, got {top_k}")
    if not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        problems.append(f"prefill_chunk must be a whole number >= 1, got {prefill_chunk}")
    return problems
