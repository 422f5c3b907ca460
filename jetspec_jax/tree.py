"""On-device draft-tree builder (JetSpec).

The draft head gives, for each depth d = 1..D, a log-softmax over the vocab; we keep its top-K
(K = tree width) as topk_logprobs / topk_tokens [D, K], row d-1 holding the candidates for depth d.
Every parent at depth d-1 gets the same candidate children (per-depth marginals).

The tree grows best-first: repeatedly pop the open node with the highest cumulative log-prob
(ties -> earliest inserted, i.e. lowest index) and append its first cap[d] candidates at once.
  accum_logp: cap[d] = K
  top2gap:    cap[d] = max(1, round(K * sigmoid(-beta * (g_d - g0)))), g_d = top-1 minus top-2
  chain:      cap[d] = 1 (a single greedy path)
Node order is insertion order, so parent index < child index. Shapes are static: N = budget
nodes including the root; nodes the tree cannot fill are padding (valid False).
`jetspec_jax.tree_reference.build_tree_numpy` is the plain heapq reference it must match.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

METHODS = ("accum_logp", "top2gap", "chain")


@flax.struct.dataclass
class DraftTree:
    tokens: jax.Array  # [..., N] int32; padding 0
    parents: jax.Array  # [..., N] int32; root and padding -1
    depths: jax.Array  # [..., N] int32; root and padding 0
    scores: jax.Array  # [..., N] float32 cumulative log-prob; padding -inf
    valid: jax.Array  # [..., N] bool
    ancestors: jax.Array  # [..., N, N] bool: [n, m] = m is n or an ancestor; padding: self only

    @property
    def num_nodes(self) -> jax.Array:
        return self.valid.sum(-1)  # [...]

    def positions(self, past_len) -> jax.Array:
        """Sequence positions of the nodes; past_len is a scalar or [B] (batched trees)."""
        return jnp.asarray(past_len, jnp.int32)[..., None] + self.depths  # [..., N]


@functools.partial(jax.jit, static_argnames="width")
def topk_from_logits(draft_logits, width: int):
    """draft_logits [..., D, V] -> topk_logprobs (f32, descending), topk_tokens: [..., D, width]."""
    if width < 1 or width > draft_logits.shape[-1]:
        raise ValueError(f"width must be in [1, vocab={draft_logits.shape[-1]}], got {width}")
    logprobs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    values, tokens = jax.lax.top_k(logprobs, width)
    return values, tokens.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="method")
def tree_caps(topk_logprobs, method: str, beta=1.0, g0=1.0) -> jax.Array:
    """Children per expanded node at each depth: topk_logprobs [..., D, K] -> [..., D] in 1..K."""
    width = topk_logprobs.shape[-1]
    ones = jnp.ones(topk_logprobs.shape[:-1], jnp.int32)
    if method == "chain" or (method == "top2gap" and width < 2):
        return ones
    if method == "accum_logp":
        return ones * width
    if method != "top2gap":
        raise ValueError(f"unknown tree method {method!r}; expected one of {METHODS}")
    lp = topk_logprobs.astype(jnp.float32)
    gap = lp[..., 0] - lp[..., 1]
    # sigmoid(-x) spelled out so the NumPy reference can do the same float32 ops; jnp.round is
    # half-to-even like Python's round(). Clip after the int cast so a NaN gap cannot give cap < 1.
    share = 1.0 / (1.0 + jnp.exp(beta * (gap - g0)))
    return jnp.clip(jnp.round(width * share).astype(jnp.int32), 1, width)


def reachable_depth(budget: int, width: int, method: str) -> int:
    """The deepest node a tree of `budget` nodes can hold. accum_logp expands every node into
    min(width, nodes left) children, so reaching depth d takes at least 1 + width * (d - 1) + 1
    nodes; chain and top2gap caps can be 1 (a chain of budget - 1)."""
    if method == "accum_logp":
        return -(-(budget - 1) // width)
    return budget - 1


def _check(topk_logprobs, topk_tokens, budget, method, batched):
    if method not in METHODS:
        raise ValueError(f"unknown tree method {method!r}; expected one of {METHODS}")
    if int(budget) != budget or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (nodes including the root), got {budget}")
    ndim = 3 if batched else 2
    if topk_logprobs.ndim != ndim or topk_logprobs.shape != topk_tokens.shape:
        want = "[B, D, K]" if batched else "[D, K]"
        raise ValueError(
            f"topk_logprobs and topk_tokens must both be {want}, got "
            f"{topk_logprobs.shape} and {topk_tokens.shape}"
        )
    if topk_logprobs.shape[-1] < 1:
        raise ValueError("tree width (K = topk_logprobs.shape[-1]) must be >= 1")


def _grow(root_token, topk_logprobs, topk_tokens, caps, *, budget: int) -> DraftTree:
    """The best-first loop for one tree; caps [D] (see tree_caps) is the only method dependence."""
    depth, width = topk_logprobs.shape  # D, K
    n = budget
    lp = topk_logprobs.astype(jnp.float32)  # [D, K]
    tk = topk_tokens.astype(jnp.int32)  # [D, K]
    caps = caps.astype(jnp.int32)  # [D]

    # Pad by K so a K-wide write at any start < N stays in bounds (dynamic_update_slice clamps).
    idx = jnp.arange(n + width)
    tokens = jnp.where(idx == 0, jnp.asarray(root_token, jnp.int32), 0)  # [N+K]
    parents = jnp.full(n + width, -1, jnp.int32)
    depths = jnp.zeros(n + width, jnp.int32)
    scores = jnp.where(idx == 0, 0.0, -jnp.inf).astype(jnp.float32)
    # open = inserted, not yet popped, and still expandable; nodes at depth D would only be
    # popped and discarded, so leaving them out keeps every iteration productive.
    open_ = (idx == 0) & (depth > 0)

    def cond(state):
        num, *_, open_ = state
        return (num < n) & open_.any()

    def body(state):
        num, tokens, parents, depths, scores, open_ = state
        masked = jnp.where(open_, scores, -jnp.inf)
        # First index among the open maxima; also right when every open score is -inf.
        best = jnp.argmax(open_ & (masked == masked.max())).astype(jnp.int32)
        d = depths[best]  # children take candidate row d, i.e. depth d + 1
        keep = jnp.arange(width) < jnp.minimum(caps[d], n - num)  # [K]

        def put(arr, new, pad):  # write the fan-out at [num, num + K), padding past the cap
            fan = jnp.where(keep, new, pad).astype(arr.dtype)  # [K]
            return jax.lax.dynamic_update_slice(arr, fan, (num,))

        return (
            num + keep.sum(dtype=jnp.int32),
            put(tokens, tk[d], 0),
            put(parents, best, -1),
            put(depths, d + 1, 0),
            put(scores, scores[best] + lp[d], -jnp.inf),
            put(open_.at[best].set(False), d + 1 < depth, False),
        )

    state = (jnp.int32(1), tokens, parents, depths, scores, open_)
    num, tokens, parents, depths, scores, _ = jax.lax.while_loop(cond, body, state)
    parents = parents[:n]
    return DraftTree(
        tokens=tokens[:n],
        parents=parents,
        depths=depths[:n],
        scores=scores[:n],
        valid=jnp.arange(n) < num,
        ancestors=ancestor_matrix(parents, depth),
    )


def ancestor_matrix(parents, max_depth: int) -> jax.Array:
    """parents [N] -> [N, N] bool ancestor-or-self matrix by pointer doubling.

    After k rounds anc[n] holds the ancestors at distance < 2**k and jump[n] the one at distance
    2**k (-1 if none); bit_length(D) rounds cover every depth <= D."""
    n = parents.shape[0]
    anc = jnp.eye(n, dtype=bool)  # [N, N]
    jump = parents  # [N]
    for _ in range(max_depth.bit_length()):
        has = (jump >= 0)[:, None]  # [N, 1]
        safe = jnp.maximum(jump, 0)
        anc = anc | (anc[safe] & has)
        jump = jnp.where(has[:, 0], jump[safe], -1)
    return anc


# The method only picks caps, so the loop compiles once per (budget, D, K) whichever method runs.
_grow_one = jax.jit(_grow, static_argnames="budget")


@functools.partial(jax.jit, static_argnames="budget")
def _grow_batch(root_tokens, topk_logprobs, topk_tokens, caps, *, budget: int) -> DraftTree:
    grow = functools.partial(_grow, budget=budget)
    return jax.vmap(grow)(root_tokens, topk_logprobs, topk_tokens, caps)


def build_tree(root_token, topk_logprobs, topk_tokens, *, budget: int, method: str = "accum_logp",
               beta=1.0, g0=1.0) -> DraftTree:
    """One tree: root_token [] int, topk_logprobs / topk_tokens [D, K] -> DraftTree with N = budget.

    budget and method are static; everything runs on device and traces cleanly inside jax.jit."""
    _check(topk_logprobs, topk_tokens, budget, method, batched=False)
    caps = tree_caps(topk_logprobs, method, beta, g0)  # [D]
    return _grow_one(root_token, topk_logprobs, topk_tokens, caps, budget=budget)


def build_trees(root_tokens, topk_logprobs, topk_tokens, *, budget: int, method: str = "accum_logp",
                beta=1.0, g0=1.0) -> DraftTree:
    """Batched: root_tokens [B], topk_* [B, D, K] -> DraftTree with fields [B, N] and [B, N, N]."""
    _check(topk_logprobs, topk_tokens, budget, method, batched=True)
    caps = tree_caps(topk_logprobs, method, beta, g0)  # [B, D]
    return _grow_batch(root_tokens, topk_logprobs, topk_tokens, caps, budget=budget)
