"""How each round's tree is drafted (`TreeSpec`), checked once, here, where the value is made.
JAX-free: the CLI checks its flags with it before JAX is imported."""

from __future__ import annotations

import dataclasses

from jetspec_jax.options import MAX_BUDGET, TREE_METHODS as METHODS


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """How each round's tree is drafted: `budget` nodes (root included), fan-out `width`.

    ngram: a chain of up to this many tokens from the context (prompt lookup, `draft/ngram.py`)
    added to the drafted tree, sharing its budget (0: none).

    buckets / bucket_costs: adaptive budget (`decode/adaptive.py`): each round picks one of
    these tree sizes, costs in seconds per round; budget must then be the largest bucket
    (`jetspec_jax.costs.auto_tree_spec` builds it)."""

    budget: int = 64
    width: int = 7
    method: str = "accum_logp"
    buckets: tuple[int, ...] = ()
    bucket_costs: tuple[float, ...] = ()
    ngram: int = 0

    def __post_init__(self):
        if problems := self.problems(self.budget, self.width, self.method, self.ngram):
            raise ValueError("; ".join(problems))
        if self.ngram and self.buckets:
            raise ValueError("n-gram chains take a fixed budget: the adaptive budget's "
                             "estimate knows the drafted nodes only")
        if self.buckets or self.bucket_costs:
            b, c = self.buckets, self.bucket_costs
            if len(b) != len(c) or list(b) != sorted(set(b)) or b[0] < 1 or b[-1] != self.budget:
                raise ValueError(f"buckets must be increasing sizes >= 1 ending at budget "
                                 f"{self.budget}, one cost each; got {b} and costs {c}")
            if not all(x > 0 for x in c):
                raise ValueError(f"bucket costs must be > 0 seconds, got {c}")

    @staticmethod
    def problems(budget: int | None, width: int = 1, method: str = "accum_logp",
                 ngram: int = 0) -> list[str]:
        """Every way these settings are out of range, one message each (empty: all fine);
        budget None: not checked."""
        problems = []
        if budget is not None and not 1 <= budget <= MAX_BUDGET:
            problems.append(f"budget must be in [1, {MAX_BUDGET}], got {budget}")
        if width < 1:
            problems.append(f"tree width must be >= 1, got {width}")
        if method not in METHODS:
            problems.append(f"unknown tree method {method!r}; choose from {METHODS}")
        if ngram < 0:
            problems.append(f"n-gram chain length must be >= 0, got {ngram}")
        return problems

    @property
    def draft_width(self) -> int:
        """Top-k kept per depth: a chain keeps one."""
        return 1 if self.method == "chain" else self.width

    def draft_depths(self, block_depth: int) -> int:
        """Depths worth drafting: those a tree of this budget can reach, at most the block's."""
        return max(1, min(block_depth, reachable_depth(self.budget, self.draft_width,
                                                       self.method)))


def reachable_depth(budget: int, width: int, method: str) -> int:
    """The deepest node a tree of `budget` nodes can hold. accum_logp expands every node into
    min(width, nodes left) children, so reaching depth d takes at least 1 + width * (d - 1) + 1
    nodes; chain and top2gap caps can be 1 (a chain of budget - 1)."""
    if method == "accum_logp":
        return -(-(budget - 1) // width)
    return budget - 1
