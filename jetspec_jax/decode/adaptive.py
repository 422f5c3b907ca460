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
(`jetspec_jax.costs.measure_costs`). The choice sits on device: `switch_budget` is a
`lax.switch` over the buckets inside the speculative `while_loop` (each branch compiled once,
with its own static tree size; only the chosen one runs), so no round trip to the host per
round.

Lossless: the tree only depends on the draft, and verification is unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jetspec_jax.draft.tree import DraftTree


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
