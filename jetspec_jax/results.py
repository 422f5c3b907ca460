"""What `api.generate` returns: the generated text and tokens with timings, acceptance
statistics (tau, its histogram, the tree sizes verified) and the comparison with
autoregressive decoding."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jetspec_jax.decode.speculative import TreeSpec


@dataclasses.dataclass
class GenerationResult:
    texts: list[str]
    tokens: list[list[int]]  # generated ids per prompt (a final stop token included)
    prompt_lens: list[int]
    seconds: float  # the generation, compiled code only
    compile_s: float  # compilation + one warm-up run (+ budget="auto"'s cost measurement);
    #                   0 when compiled code (and measured costs) were reused
    attn_impl: str
    draft: str | None = None  # the head's path; None: autoregressive decoding
    tree_spec: TreeSpec | None = None
    rounds: list[int] | None = None  # speculative rounds per sequence
    accepted: list[list[int]] | None = None  # tokens committed in each round, per sequence
    nodes: list[list[int]] | None = None  # tree size verified in each round, per sequence
    ar_tokens: list[list[int]] | None = None  # with compare_autoregressive
    ar_seconds: float | None = None
    ar_compile_s: float | None = None
    greedy: bool = True

    @property
    def mode(self) -> str:
        return "autoregressive" if self.rounds is None else "speculative"

    @property
    def num_generated(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.seconds

    @property
    def tau(self) -> list[float] | None:
        """Mean tokens committed per round (accepted drafts + 1), per sequence."""
        if self.accepted is None:
            return None
        return [sum(a) / max(len(a), 1) for a in self.accepted]

    @property
    def tau_mean(self) -> float | None:
        if self.accepted is None:
            return None
        return sum(map(sum, self.accepted)) / max(sum(map(len, self.accepted)), 1)

    @property
    def tau_hist(self) -> list[int] | None:
        """tau_hist[k]: rounds (all sequences) that committed k tokens."""
        if self.accepted is None:
            return None
        return np.bincount(np.asarray([k for a in self.accepted for k in a], int)).tolist()

    @property
    def bucket_mix(self) -> dict[int, int] | None:
        """Tree size -> rounds that verified it (the batch shares each round's size; with
        budget="auto" the size is chosen per round)."""
        if self.nodes is None:
            return None
        sizes = [max(n[r] for n in self.nodes if len(n) > r)
                 for r in range(max(map(len, self.nodes), default=0))]
        return dict(sorted(collections.Counter(sizes).items()))

    @property
    def ar_tokens_per_s(self) -> float | None:
        return None if self.ar_tokens is None else sum(map(len, self.ar_tokens)) / self.ar_seconds

    @property
    def speedup(self) -> float | None:
        return None if self.ar_tokens is None else self.tokens_per_s / self.ar_tokens_per_s

    @property
    def ar_identical(self) -> bool | None:
        """Greedy speculative output == greedy autoregressive output (None when sampling)."""
        return None if self.ar_tokens is None or not self.greedy else self.ar_tokens == self.tokens

    def summary(self) -> str:
        lines = []
        if self.mode == "speculative":
            t = self.tree_spec
            budget = (f"auto (buckets {', '.join(map(str, t.buckets))})" if t.buckets
                      else t.budget)
            lines.append(f"speculative: draft {self.draft}, budget {budget}, width {t.width}, "
                         f"tree {t.method}" + (f", n-gram chain {t.ngram}" if t.ngram else "")
                         + f", attention {self.attn_impl}")
            taus = ", ".join(f"{x:.2f}" for x in self.tau)
            lines.append(f"  tau {self.tau_mean:.2f} tokens per round"
                         + (f" (per prompt: {taus})" if len(self.tau) > 1 else "")
                         + f"; {sum(self.rounds)} rounds")
            if t.buckets:
                lines.append(f"  tree sizes chosen: {format_mix(self.bucket_mix)}")
        else:
            lines.append(f"autoregressive: attention {self.attn_impl}")
        lines.append(f"  {self.num_generated} tokens in {self.seconds:.3f} s: "
                     f"{self.tokens_per_s:.1f} tok/s (compile + warm-up {self.compile_s:.1f} s)")
        if self.ar_tokens is not None:
            same = {None: "n/a (sampling)", True: "yes", False: "NO"}[self.ar_identical]
            lines.append(f"  autoregressive: {self.ar_tokens_per_s:.1f} tok/s (compile + warm-up "
                         f"{self.ar_compile_s:.1f} s); speedup {self.speedup:.2f}x; greedy "
                         f"outputs identical: {same}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        keys = ("mode", "texts", "tokens", "prompt_lens", "draft", "attn_impl", "seconds",
                "compile_s", "num_generated", "tokens_per_s", "rounds", "tau", "tau_mean",
                "tau_hist", "nodes", "bucket_mix", "ar_seconds", "ar_compile_s",
                "ar_tokens_per_s", "speedup", "ar_identical")
        d = {k: getattr(self, k) for k in keys}
        d["tree_spec"] = self.tree_spec and dataclasses.asdict(self.tree_spec)
        return d


def format_mix(mix: dict[int, int]) -> str:
    """{16: 3, 32: 10} -> "16 x 3, 32 x 10 rounds"."""
    return ", ".join(f"{size} x {n}" for size, n in mix.items()) + " rounds"
