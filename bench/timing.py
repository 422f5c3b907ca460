"""How the benches time a call, in one place: untimed warm-up calls first (compile, caches),
each timed call blocked until its outputs are ready (JAX dispatches asynchronously, so an
unblocked call times only the dispatch), and the median of the samples (robust to the odd
slow one)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def sample_seconds(fn: Callable[..., Any], *args: Any, repeats: int,
                   warmup: int = 1) -> list[float]:
    """Wall seconds of each of `repeats` calls of `fn(*args)`, after `warmup` untimed ones."""
    import jax  # here, not at the top: the benches' torch-only stages never import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return times


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn(*args)` over `repeats` calls, after `warmup` untimed ones."""
    return statistics.median(sample_seconds(fn, *args, repeats=repeats, warmup=warmup))
