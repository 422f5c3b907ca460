"""Plain NumPy + heapq reference for `jetspec_jax.draft.tree.build_tree` (tests only; slow, host-side).

It follows the JetSpec pseudo-code literally, with float32 score arithmetic, so the on-device
builder must match it exactly (same node order, tokens, parents, depths, scores)."""

from __future__ import annotations

import heapq

import numpy as np


def tree_caps_numpy(topk_logprobs, method: str, beta=1.0, g0=1.0) -> np.ndarray:
    """topk_logprobs [D, K] -> children per expanded node at each depth, [D] int."""
    lp = np.asarray(topk_logprobs, np.float32)
    depth, width = lp.shape
    if method == "accum_logp":
        return np.full(depth, width, np.int64)
    if method == "chain" or (method == "top2gap" and width < 2):
        return np.ones(depth, np.int64)
    if method != "top2gap":
        raise ValueError(f"unknown tree method {method!r}")
    with np.errstate(over="ignore", invalid="ignore"):  # -inf log-probs: inf / NaN gaps
        gap = lp[:, 0] - lp[:, 1]
        share = np.float32(1) / (np.float32(1) + np.exp(np.float32(beta) * (gap - np.float32(g0))))
    # Python's round() is half-to-even, like jnp.round; a NaN gap falls back to cap 1.
    caps = [1 if np.isnan(v) else min(width, max(1, round(float(v)))) for v in width * share]
    return np.array(caps, np.int64)


def build_tree_numpy(root_token, topk_logprobs, topk_tokens, budget, method="accum_logp",
                     beta=1.0, g0=1.0) -> dict[str, np.ndarray]:
    """Returns the DraftTree fields as NumPy arrays, padded to `budget` nodes."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    lp = np.asarray(topk_logprobs, np.float32)  # [D, K]
    tk = np.asarray(topk_tokens)  # [D, K]
    depth, width = lp.shape
    caps = tree_caps_numpy(lp, method, beta, g0)

    tokens, parents, depths, scores = [int(root_token)], [-1], [0], [np.float32(0.0)]
    heap = [(-0.0, 0)]  # (-score, insertion index): heapq pops the lowest, i.e. the best score
    while heap and len(tokens) < budget:
        _, node = heapq.heappop(heap)
        d = depths[node]
        if d >= depth:
            continue
        for j in range(min(int(caps[d]), width, budget - len(tokens))):
            score = np.float32(scores[node] + lp[d, j])
            tokens.append(int(tk[d, j]))
            parents.append(node)
            depths.append(d + 1)
            scores.append(score)
            heapq.heappush(heap, (-float(score), len(tokens) - 1))

    num = len(tokens)
    pad = budget - num
    ancestors = np.eye(budget, dtype=bool)
    for node in range(num):
        m = node
        while m >= 0:
            ancestors[node, m] = True
            m = parents[m]
    return dict(
        tokens=np.array(tokens + [0] * pad, np.int32),
        parents=np.array(parents + [-1] * pad, np.int32),
        depths=np.array(depths + [0] * pad, np.int32),
        scores=np.array(scores + [-np.inf] * pad, np.float32),
        valid=np.arange(budget) < num,
        ancestors=ancestors,
    )
