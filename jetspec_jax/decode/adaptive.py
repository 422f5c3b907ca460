"""Adaptive draft budget: each round picks its tree size from a few compiled buckets.

Expected acceptance from the draft's own scores. If the draft's probabilities were the
target's, a node would be accepted with probability prod of q along its path = exp(score)
(score = cumulative log-prob from the root), and the expected number of committed tokens of a
tree (accepted drafts + the bonus token) is sum over its valid nodes of exp(score), the root
counting exp(0) = 1.

Buckets are prefixes. The best-first builders (`accum_logp`, `top2gap`, `chain`) insert nodes
in the same order whatever the budget, so the tree of budget b is the first b nodes of the
tree of the largest budget. One first pass and one tree build at the largest bucket give every
bucket's tree and expected tokens E_b (a cumulative sum).

The choice. Each round takes the bucket maximising expected tokens per second,
sum over active sequences of E_b / cost_b (the batch shares one tree size: shapes are static),
where cost_b is a round's wall time at budget b measured on the device at start-up
(`measure_costs`). The choice sits on device: `switch_budget` is a `lax.switch` over the
buckets inside the speculative `while_loop` (each branch compiled once, with its own static
tree size; only the chosen one runs), so no round trip to the host per round.

Lossless: the tree only depends on the draft, and verification is unchanged.
With `draft_mode="path"` the choice uses the first-pass scores and the chosen prefix is then
refined (the refined scores are only known after the choice).
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

from jetspec_jax.decode.tree import DraftTree
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.options import GPU_BUCKETS as DEFAULT_BUCKETS  # jax-free: the CLI reads it


def prefix_tree(tree: DraftTree, n: int) -> DraftTree:
    """The first n nodes of a (batched) tree: the tree a best-first builder makes at budget n."""
    return DraftTree(tokens=tree.tokens[..., :n], parents=tree.parents[..., :n],
                     depths=tree.depths[..., :n], scores=tree.scores[..., :n],
                     valid=tree.valid[..., :n], ancestors=tree.ancestors[..., :n, :n])


def expected_tokens(scores, valid, buckets) -> jax.Array:
    """scores, valid [B, N] of a best-first tree -> [B, len(buckets)]: expected tokens committed
    per round (accepted drafts + 1) by the tree's first b nodes, for each bucket b <= N."""
    p = jnp.where(valid, jnp.exp(scores.astype(jnp.float32)), 0.0)  # [B, N]
    return jnp.cumsum(p, axis=-1)[:, jnp.asarray(buckets) - 1]


def choose_bucket(expected, active, costs) -> jax.Array:
    """expected [B, nb], active [B], costs [nb] (seconds per round) -> int32 bucket index
    maximising the batch's expected tokens per second (first maximum on ties)."""
    tokens = jnp.sum(jnp.where(active[:, None], expected, 0.0), axis=0)  # [nb]
    return jnp.argmax(tokens / jnp.asarray(costs, jnp.float32)).astype(jnp.int32)


def switch_budget(tree: DraftTree, active, buckets, costs, finish):
    """Runs finish(prefix_tree(tree, b)) for the bucket b chosen from the tree's scores.
    tree: first-pass trees of size max(buckets); finish: tree -> next loop state."""
    index = choose_bucket(expected_tokens(tree.scores, tree.valid, buckets), active, costs)
    branches = [functools.partial(lambda n, t: finish(prefix_tree(t, n)), b) for b in buckets]
    return jax.lax.switch(index, branches, tree)


def measure_costs(tparams, tcfg, dparams, dcfg, *, buckets=DEFAULT_BUCKETS, width: int = 7,
                  method: str = "accum_logp", draft_mode: str = "per_depth", batch: int = 1,
                  context_len: int = 256, kernels: Kernels = Kernels(), cache_dtype=None,
                  repeats: int = 10, seed: int = 0) -> dict[int, float]:
    """{bucket: seconds} of one speculative round (draft, tree, verify, accept, commit) at a
    fixed budget, on this device, for a batch at context length context_len: median of
    `repeats` runs after a warm-up, each timed with block_until_ready. Random prompt tokens:
    the cost does not depend on the values."""
    from jetspec_jax.decode import speculative  # speculative imports this module
    from jetspec_jax.decode.sampling import Sampler

    blk = dcfg.block_size
    max_new = 2 * blk
    slots = context_len + max_new + speculative.working_slots(max(buckets), blk, draft_mode)
    static = dict(max_new=max_new, sampler=Sampler(), stop_ids=(), kernels=kernels)
    prompt = jax.random.randint(jax.random.key(seed), (batch, context_len), 0, tcfg.vocab_size,
                                jnp.int32)
    init = jax.jit(speculative.init_state, static_argnames=(
        "tcfg", "dcfg", "max_new", "sampler", "stop_ids", "num_slots", "kernels",
        "cache_dtype"))
    state = init(tparams, tcfg=tcfg, dparams=dparams, dcfg=dcfg, prompt=prompt,
                 prompt_lens=jnp.full((batch,), context_len, jnp.int32), key=jax.random.key(seed),
                 num_slots=slots, cache_dtype=cache_dtype or tparams["embed"].dtype, **static)
    table = {}
    for b in buckets:
        spec = speculative.TreeSpec(b, width, method, draft_mode)
        step = jax.jit(lambda tp, dp, s, spec=spec: speculative.speculative_round(
            tp, tcfg, dp, dcfg, s, tree_spec=spec, **static))
        for _ in range(2):
            jax.block_until_ready(step(tparams, dparams, state))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(tparams, dparams, state))
            times.append(time.perf_counter() - start)
        table[b] = statistics.median(times)
    return table


def auto_tree_spec(costs: dict[int, float], *, width: int = 7, method: str = "accum_logp",
                   draft_mode: str = "per_depth"):
    """The TreeSpec of `budget="auto"`: buckets and their costs from a `measure_costs` table;
    the budget (what cache sizing sees) is the largest bucket."""
    from jetspec_jax.decode.speculative import TreeSpec

    buckets = tuple(sorted(costs))
    return TreeSpec(budget=buckets[-1], width=width, method=method, draft_mode=draft_mode,
                    buckets=buckets, bucket_costs=tuple(float(costs[b]) for b in buckets))
