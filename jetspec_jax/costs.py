"""Round costs for the adaptive budget, measured on the host: one speculative round timed per
tree-size bucket (`measure_costs`), and the TreeSpec built from them (`auto_tree_spec`). The
on-device choice between buckets is `decode.adaptive`."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from jetspec_jax.decode import speculative
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.speculative import TreeSpec
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.options import GPU_BUCKETS


def measure_costs(tparams, tcfg, dparams, dcfg, *, buckets=GPU_BUCKETS, width: int = 7,
                  method: str = "accum_logp", batch: int = 1,
                  context_len: int = 256, kernels: Kernels = Kernels(), cache_dtype=None,
                  repeats: int = 10, seed: int = 0) -> dict[int, float]:
    """{bucket: seconds} of one speculative round (draft, tree, verify, accept, commit) at a
    fixed budget, on this device, for a batch at context length context_len: median of
    `repeats` runs after a warm-up, each timed with block_until_ready. Random prompt tokens:
    the cost does not depend on the values."""
    blk = dcfg.block_size
    max_new = 2 * blk
    slots = context_len + max_new + speculative.working_slots(max(buckets), blk)
    loop = Loop(max_new=max_new, num_slots=slots, kernels=kernels,
                cache_dtype=cache_dtype or tparams["embed"].dtype)
    prompt = jax.random.randint(jax.random.key(seed), (batch, context_len), 0, tcfg.vocab_size,
                                jnp.int32)
    init = jax.jit(speculative.init_state, static_argnames=("tcfg", "dcfg", "sampler", "loop"))
    state = init(tparams, tcfg=tcfg, dparams=dparams, dcfg=dcfg, prompt=prompt,
                 prompt_lens=jnp.full((batch,), context_len, jnp.int32), key=jax.random.key(seed),
                 sampler=Sampler(), loop=loop)
    table = {}
    for b in buckets:
        spec = TreeSpec(b, width, method)
        step = jax.jit(lambda tp, dp, s, spec=spec: speculative.speculative_round(
            tp, tcfg, dp, dcfg, s, tree_spec=spec, sampler=Sampler(), loop=loop))
        for _ in range(2):
            jax.block_until_ready(step(tparams, dparams, state))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(tparams, dparams, state))
            times.append(time.perf_counter() - start)
        table[b] = statistics.median(times)
    return table


def auto_tree_spec(costs: dict[int, float], *, width: int = 7, method: str = "accum_logp"):
    """The TreeSpec of `budget="auto"`: buckets and their costs from a `measure_costs` table;
    the budget (what cache sizing sees) is the largest bucket."""
    buckets = tuple(sorted(costs))
    return TreeSpec(budget=buckets[-1], width=width, method=method, buckets=buckets,
                    bucket_costs=tuple(float(costs[b]) for b in buckets))
