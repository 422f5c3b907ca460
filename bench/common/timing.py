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


def loop_seconds(run: Callable[..., Any], *args: Any, reps: int,
                 repeats: int) -> tuple[float, float, Any]:
    """For `run(*args, n)`, a jitted loop of n passes with n traced (one program for every n):
    (seconds per pass, compile seconds, the output of one pass). Per pass is (t(reps) - t(1))
    / (reps - 1) from medians of `repeats` calls, so dispatch cancels; nan when noise makes
    t(reps) <= t(1) (tiny shapes on a CPU)."""
    import jax

    t = time.perf_counter()
    once = jax.block_until_ready(run(*args, 1))  # compiles; also the warm-up of both counts
    compile_s = time.perf_counter() - t
    t1 = median_seconds(run, *args, 1, repeats=repeats, warmup=0)
    tr = median_seconds(run, *args, reps, repeats=repeats, warmup=0)
    per = (tr - t1) / (reps - 1) if tr > t1 else float("nan")
    return per, compile_s, once


def chained_matmuls(mm: Callable[..., Any]) -> Callable[..., Any]:
    """jit(ws, x, *extra, reps) -> float32 sum over reps and layers of mm(x, w, *extra), for
    timing one matmul per layer. Each layer's x is nudged by the previous output (as in a
    model, one matmul after the other), so that XLA neither hoists the matmuls out of the loop
    nor merges dots that share x (DotMerger concatenates their weights: a copy)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(ws, x, *rest):
        *extra, reps = rest

        def body(_, carry):
            x, acc = carry
            for w in ws:
                y = mm(x, w, *extra).astype(jnp.float32)
                acc = acc + y
                x = x + (y[:, :1] * 1e-9).astype(x.dtype)
            return x, acc

        acc = jnp.zeros((x.shape[0], ws[0].shape[-1]), jnp.float32)
        return jax.lax.fori_loop(0, reps, body, (x, acc))[1]

    return run
