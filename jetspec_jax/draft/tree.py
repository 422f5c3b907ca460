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
`jetspec_jax.draft.tree_reference.build_tree_numpy` is the plain heapq reference it must match.

Without the loop (`_grow_sorted`; `_statics` says which methods use it): log-probs are <= 0,
so a child never beats its parent and the heap pops nodes in one fixed "pop order": higher score
first, ties by the parent's pop order, then sibling rank (= insertion order). The pops are a
prefix of it, at most M = max_pops long, at depths < L = min(D, M). A node's parent comes before
it, so the first M nodes of depth <= t all have parents among the first M of depth <= t-1, and
t rounds of
    G <- the first M of [root, child j of G[i] at 1 + i*K + j], stably sorted by score
(the layout breaks score ties exactly like the pop order) leave the first M of depth <= t in G.
Pop p's children then take slots 1 + (children of the pops before p) onwards: cumsums and
gathers. So L sorts of M*K + 1 keys replace M sequential pops (accum_logp N=256, K=7, D=15:
15 instead of 37); a chain (method chain, or K = 1) is a path and needs no sort at all.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.draft.tree_spec import METHODS, TreeSpec


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
    """draft_logits [..., D, V] -> topk_logprobs (f32, descending), topk_tokens: [..., D, width].

    The top-K of the logits, normalised alone with log_softmax's own float ops: no [D, V]
    log-probabilities are made, which XLA:CPU fused into the tree build's program at 20-40x
    the cost of the two apart."""
    if width < 1 or width > draft_logits.shape[-1]:
        raise ValueError(f"width must be in [1, vocab={draft_logits.shape[-1]}], got {width}")
    logits = draft_logits.astype(jnp.float32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
    values, tokens = jax.lax.top_k(logits, width)
    return (values - top) - log_total, tokens.astype(jnp.int32)


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


def _check(topk_logprobs, topk_tokens, budget, method, batched):
    if problems := TreeSpec.problems(budget, method=method):
        raise ValueError("; ".join(problems))
    ndim = 3 if batched else 2
    if topk_logprobs.ndim != ndim or topk_logprobs.shape != topk_tokens.shape:
        want = "[B, D, K]" if batched else "[D, K]"
        raise ValueError(
            f"topk_logprobs and topk_tokens must both be {want}, got "
            f"{topk_logprobs.shape} and {topk_tokens.shape}"
        )
    if topk_logprobs.shape[-1] < 1:
        raise ValueError("tree width (K = topk_logprobs.shape[-1]) must be >= 1")


def max_pops(budget: int, width: int, depth: int, method: str) -> int:
    """An upper bound on the best-first loop's pops, so it can run a static trip count: on a
    GPU a data-dependent `while_loop` reads its predicate back to the host every iteration.
    Every pop but the last adds cap >= 1 children (accum_logp: exactly `width`); a chain pops
    each depth once."""
    if method == "accum_logp":
        return -(-(budget - 1) // width)
    if method == "chain":
        return min(budget - 1, depth)
    return budget - 1


def _grow_loop(root_token, topk_logprobs, topk_tokens, caps, *, budget: int,
               pops: int) -> DraftTree:
    """The best-first loop for one tree, `pops` iterations (max_pops; the spare ones change
    nothing); caps [D] (see tree_caps) is the only other method dependence."""
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

    def body(_, state):
        num, tokens, parents, depths, scores, open_ = state
        live = (num < n) & open_.any()
        masked = jnp.where(open_, scores, -jnp.inf)
        # First index among the open maxima; also right when every open score is -inf.
        best = jnp.argmax(open_ & (masked == masked.max())).astype(jnp.int32)
        d = depths[best]  # children take candidate row d, i.e. depth d + 1
        # A finished tree writes padding over padding at [num, num + K): nothing changes.
        keep = jnp.arange(width) < jnp.where(live, jnp.minimum(caps[d], n - num), 0)  # [K]

        def put(arr, new, pad):  # write the fan-out at [num, num + K), padding past the cap
            fan = jnp.where(keep, new, pad).astype(arr.dtype)  # [K]
            return jax.lax.dynamic_update_slice(arr, fan, (num,))

        return (
            num + keep.sum(dtype=jnp.int32),
            put(tokens, tk[d], 0),
            put(parents, best, -1),
            put(depths, d + 1, 0),
            put(scores, scores[best] + lp[d], -jnp.inf),
            put(open_.at[best].set(open_[best] & ~live), d + 1 < depth, False),
        )

    state = (jnp.int32(1), tokens, parents, depths, scores, open_)
    num, tokens, parents, depths, scores, _ = jax.lax.fori_loop(0, pops, body, state)
    parents = parents[:n]
    return DraftTree(
        tokens=tokens[:n],
        parents=parents,
        depths=depths[:n],
        scores=scores[:n],
        valid=jnp.arange(n) < num,
        ancestors=ancestor_matrix(parents, depth),
    )


def _grow_sorted(root_token, topk_logprobs, topk_tokens, caps, *, budget: int, pops: int,
                 fan: int) -> DraftTree:
    """The same tree without the pop loop (module docstring); fan = a static bound on caps."""
    depth, width = topk_logprobs.shape  # D, K
    n, m = budget, max(pops, 1)
    lp = topk_logprobs.astype(jnp.float32)  # [D, K]
    tk = topk_tokens.astype(jnp.int32)  # [D, K]
    caps = caps.astype(jnp.int32)  # [D]
    levels = min(depth, pops)  # a depth-d pop needs d pops before it: only depths < levels
    idx = jnp.arange(m, dtype=jnp.int32)

    # G = the first m poppable nodes in pop order: score, depth, parent (its index in G; -1 for
    # the root), sibling rank, valid.
    if fan == 1:  # a path: node k is at depth k (scores summed in the same order as the loop)
        score = [jnp.float32(0)]
        for k in range(levels - 1):
            score.append(score[-1] + lp[k, 0])
        score = jnp.full(m, -jnp.inf, jnp.float32).at[:len(score)].set(jnp.stack(score))
        g = (score, idx, idx - 1, jnp.zeros(m, jnp.int32), idx < levels)
    else:
        g = (jnp.where(idx == 0, 0.0, -jnp.inf), jnp.zeros(m, jnp.int32),
             jnp.full(m, -1, jnp.int32), jnp.zeros(m, jnp.int32), idx == 0)

        def grow(_, g):
            score, dep, _, _, ok = g
            row = jnp.minimum(dep, depth - 1)
            kid = score[:, None] + lp[row, :fan]  # [m, fan]: child j of node i
            good = (ok & (dep + 1 < levels))[:, None] & (jnp.arange(fan) < caps[row][:, None])
            # The root (score 0) at 0, then child j of node i at 1 + i * fan + j: a stable sort
            # breaks score ties by parent's pop order, then sibling rank, i.e. by pop order.
            # -score >= 0 as int32 bits orders like the float (-0.0 -> 0); invalid goes last.
            bits = jnp.maximum(jax.lax.bitcast_convert_type(-kid, jnp.int32), 0)
            key = jnp.where(good, bits, jnp.iinfo(jnp.int32).max).ravel()
            key = jnp.concatenate([jnp.zeros(1, jnp.int32), key])
            _, u = jax.lax.sort((key, jnp.arange(key.size, dtype=jnp.int32)), num_keys=1,
                                is_stable=True)
            root, c = u[:m] == 0, jnp.maximum(u[:m] - 1, 0)
            i, j = c // fan, c % fan
            return (jnp.where(root, 0.0, kid.ravel()[c]), jnp.where(root, 0, dep[i] + 1),
                    jnp.where(root, -1, i), jnp.where(root, 0, j), root | good.ravel()[c])

        # Round t makes G the first m nodes of depth <= t; the last round adds nothing but
        # makes parent indices point into the final G.
        g = jax.lax.fori_loop(0, levels, grow, g)
    score, dep, par, sib, ok = g

    # Pops are G's valid nodes in order, while nodes are left: pop p's children take slots
    # start[p] .. start[p] + cap - 1, so a popped node's own slot is start[parent] + sib.
    kids = jnp.where(ok, caps[dep], 0)
    start = 1 + jnp.cumsum(kids) - kids
    taken = ok & (start < n)
    own = jnp.where(par < 0, 0, start[par] + sib)
    # Slot s >= 1 is child s - start[p] of the last taken pop p with start[p] <= s.
    slot = jnp.arange(n, dtype=jnp.int32)
    p = jnp.cumsum(jnp.zeros(n, jnp.int32).at[start].add(taken, mode="drop")) - 1
    pc = jnp.maximum(p, 0)
    j = slot - start[pc]
    child = (p >= 0) & (j < kids[pc])
    d, j = dep[pc], jnp.minimum(j, width - 1)
    parents = jnp.where(child, own[pc], -1)
    return DraftTree(
        tokens=jnp.where(child, tk[d, j], jnp.where(slot == 0, root_token, 0).astype(jnp.int32)),
        parents=parents,
        depths=jnp.where(child, d + 1, 0),
        scores=jnp.where(child, score[pc] + lp[d, j], jnp.where(slot == 0, 0.0, -jnp.inf)),
        valid=child | (slot == 0),
        ancestors=ancestor_matrix(parents, depth),
    )


def _grow(root_token, topk_logprobs, topk_tokens, caps, *, budget: int, pops: int, fan: int,
          loop: bool) -> DraftTree:
    if loop:
        return _grow_loop(root_token, topk_logprobs, topk_tokens, caps, budget=budget, pops=pops)
    return _grow_sorted(root_token, topk_logprobs, topk_tokens, caps, budget=budget, pops=pops,
                        fan=fan)


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


def root_trees(anchor, n: int) -> DraftTree:
    """Trees of n nodes holding the root (anchor [B]) only."""
    b, idx = anchor.shape[0], jnp.arange(n)
    first = jnp.broadcast_to(idx == 0, (b, n))
    return DraftTree(tokens=jnp.where(first, anchor[:, None], 0).astype(jnp.int32),
                     parents=jnp.full((b, n), -1, jnp.int32), depths=jnp.zeros((b, n), jnp.int32),
                     scores=jnp.where(first, 0.0, -jnp.inf).astype(jnp.float32), valid=first,
                     ancestors=jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n)))


# The method picks caps and the static arguments; one compile per their values and (D, K).
_STATIC = ("budget", "pops", "fan", "loop")
_grow_one = jax.jit(_grow, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _grow_batch(root_tokens, topk_logprobs, topk_tokens, caps, **static) -> DraftTree:
    grow = functools.partial(_grow, **static)
    return jax.vmap(grow)(root_tokens, topk_logprobs, topk_tokens, caps)


def _statics(budget: int, method: str, depth: int, width: int) -> dict:
    """Static arguments of _grow. The sorted builder runs min(D, pops) rounds (a chain: none)
    where the loop runs `pops` pops, each round sorting pops * K + 1 keys. On a GPU it is
    the faster at every size measured, most for top2gap, whose pops bound N - 1 makes the loop
    long (docs/benchmarks.md, tree building). On the CPU a sort costs a few pops, so there the
    loop serves top2gap and trees with pops <= D."""
    pops = max_pops(budget, width, depth, method)
    fan = 1 if method == "chain" else width
    on_cpu = jax.default_backend() == "cpu"
    loop = fan > 1 and on_cpu and (method == "top2gap" or pops <= depth)
    return dict(budget=budget, pops=pops, fan=fan, loop=loop)


def build_tree(root_token, topk_logprobs, topk_tokens, *, budget: int, method: str = "accum_logp",
               beta=1.0, g0=1.0) -> DraftTree:
    """One tree: root_token [] int, topk_logprobs / topk_tokens [D, K] -> DraftTree with N = budget.

    budget and method are static; everything runs on device and traces cleanly inside jax.jit."""
    _check(topk_logprobs, topk_tokens, budget, method, batched=False)
    caps = tree_caps(topk_logprobs, method, beta, g0)  # [D]
    return _grow_one(root_token, topk_logprobs, topk_tokens, caps,
                     **_statics(budget, method, *topk_logprobs.shape))


def build_trees(root_tokens, topk_logprobs, topk_tokens, *, budget: int, method: str = "accum_logp",
                beta=1.0, g0=1.0) -> DraftTree:
    """Batched: root_tokens [B], topk_* [B, D, K] -> DraftTree with fields [B, N] and [B, N, N]."""
    _check(topk_logprobs, topk_tokens, budget, method, batched=True)
    caps = tree_caps(topk_logprobs, method, beta, g0)  # [B, D]
    return _grow_batch(root_tokens, topk_logprobs, topk_tokens, caps,
                       **_statics(budget, method, *topk_logprobs.shape[1:]))
