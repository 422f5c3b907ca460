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
HEAD_ATTENTION = ("auto", "reference", "cudnn")  # a head's attention in training (trainer)


def kernel_names(choice) -> tuple[str, ...]:
    """"auto", a name, a comma-separated list of names (what flags take) or a sequence of
    names -> the tuple of names."""
    if isinstance(choice, str):
        return tuple(n.strip() for n in choice.split(","))
    return tuple(choice)


def check_kernel_name(kind: str, choice, names: tuple[str, ...]) -> None:
    """A name among `names` ("attention" or "matmul" kernels), or an ordered list of them
    ("auto" alone only), else one line naming the choices."""
    chosen = kernel_names(choice)
    listed = [n for n in names if n != "auto"]
    if chosen == ("auto",) and "auto" in names:
        return
    bad = [n for n in chosen if n not in listed]
    if bad or not chosen:
        raise ValueError(f"unknown {kind} kernel {', '.join(map(repr, bad)) or repr(choice)}; "
                         f"choose from {', '.join(names)}, or a comma-separated list of "
                         f"{', '.join(listed)} (tried in order)")


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
