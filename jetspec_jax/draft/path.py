"""Path-conditioned drafting: a second head pass that conditions every tree node on its path.

The first pass (`draft_head.draft_block`) gives per-depth marginals q_d: every node at depth d
gets the same candidate children whatever branch it sits on. Given that first tree T1 (N nodes,
root = anchor), one more head forward scores the tree's own tokens:

What the head sees. 2N query slots against the cached context (positions start at the
context length p, as in `draft_block`):
  node slot i   the embedding of node i's token (the anchor for the root) at position
                p + depth(i); it sees the context and the node slots of i's ancestors and
                itself (the tree's ancestor mask);
  probe slot i  the MASK embedding at position p + depth(i) + 1; it sees the context, the
                node slots of i's ancestors and itself, and itself.
The head drafts a slot's own token from a MASK input, so probe i, which sees exactly
[anchor, t_1, ..., t_d, MASK] along i's path, gives c_i = log q(. | path(i)): the distribution
of the token after node i given its exact path. For a causal head this is, bit for bit in
exact arithmetic, slot d+1 of a block whose slots 1..d hold the path tokens.

Re-growth from the conditionals (static shapes, on device). Candidates are
  - every valid node of T1, and
  - for every valid node i of T1 at depth < D (D = block size - 1) its top-`width` tokens
    under c_i that are not already a child of i in T1, as new children of i.
The score of a candidate is the sum of the conditional log-probs along its path:
S(root) = 0, S(child v of i) = S(i) + c_i[v]. Every candidate's ancestors are nodes of T1, so
every score is exact. The refined tree keeps the N best candidates by score, ties to the
lower candidate index (T1 nodes first, in insertion order, then the new children). Scores
never increase from parent to child (log-probs <= 0, and each is one float addition on its
parent's), and a parent has a lower index than its children, so the kept set is closed under
parents: it is what best-first growth over the candidates would keep. Nodes are then
renumbered with parents first; siblings keep distinct tokens, depth stays <= D.
The refined tree holds the N most likely paths (under the head's own conditionals) among
those the candidates allow, so its expected acceptance under the head is >= that of T1.

Verification is unchanged, so decoding stays lossless whatever tree is drafted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jetspec_jax.decode.tree import DraftTree, ancestor_matrix
from jetspec_jax.draft import head as draft_head
from jetspec_jax.draft.head import DraftConfig
from jetspec_jax.model import target
from jetspec_jax.model.cache import KVCache
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels


def tree_inputs(dparams, dcfg: DraftConfig, tparams, tree: DraftTree, context_len):
    """Inputs of the second pass (see the module docstring): node slots then probe slots.
    -> x [B, 2N, D], positions [B, 2N], mask [B, 2N, 2N]."""
    nodes = target.embed(tparams, tree.tokens)  # [B, N, D]
    probes = draft_head.mask_inputs(dparams, dcfg, tparams, tree.tokens.shape)  # [B, N, D]
    x = jnp.concatenate([nodes, probes], axis=1)
    pos = tree.positions(context_len)  # [B, N]
    anc = tree.ancestors  # [B, N, N]
    eye = jnp.broadcast_to(jnp.eye(anc.shape[-1], dtype=bool), anc.shape)
    mask = jnp.concatenate([jnp.concatenate([anc, jnp.zeros_like(anc)], axis=-1),
                            jnp.concatenate([anc, eye], axis=-1)], axis=1)
    return x, jnp.concatenate([pos, pos + 1], axis=1), mask


def conditional_logits(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, cache: KVCache,
                       tree: DraftTree, *, kernels: Kernels = Kernels()):
    """float32 logits [B, N, V] of the token after each node given its path (probe slots)."""
    x, positions, mask = tree_inputs(dparams, dcfg, tparams, tree, cache.lengths)
    hidden = draft_head.head_hidden(dparams, dcfg, cache, x, positions, mask,
                                    kernels=kernels)
    return target.lm_head(tparams, tcfg, hidden[:, tree.tokens.shape[1]:], kernels)


def _regrow(tree: DraftTree, logp, *, width: int, max_depth: int) -> DraftTree:
    """One tree: T1 [N] fields, logp [N, V] conditional log-probs -> refined tree of N nodes."""
    n = tree.tokens.shape[0]
    has_parent = tree.valid & (tree.parents >= 0)
    up = jnp.maximum(tree.parents, 0)
    edge = jnp.where(has_parent, jnp.minimum(logp[up, tree.tokens], 0.0), 0.0)  # [N]
    score = jnp.zeros((n,), jnp.float32)
    for _ in range(max_depth):  # S(i) = S(parent) + edge(i), one float add per edge
        score = jnp.where(has_parent, score[up] + edge, 0.0)

    top_lp, top_tok = jax.lax.top_k(logp, width)  # [N, K]
    top_lp = jnp.minimum(top_lp, 0.0)
    existing = (tree.valid & (tree.parents >= 0))[None, None, :] & (
        tree.parents[None, None, :] == jnp.arange(n)[:, None, None]) & (
        tree.tokens[None, None, :] == top_tok[:, :, None])  # [N, K, N]: already a child
    grow = (tree.valid & (tree.depths < max_depth))[:, None] & ~existing.any(-1)  # [N, K]

    # Candidates: the N nodes of T1, then N*K new children (row-major over (parent, rank)).
    cand_valid = jnp.concatenate([tree.valid, grow.reshape(-1)])
    cand_score = jnp.concatenate([score, (score[:, None] + top_lp).reshape(-1)])
    cand_token = jnp.concatenate([tree.tokens, top_tok.reshape(-1).astype(jnp.int32)])
    cand_parent = jnp.concatenate([tree.parents, jnp.repeat(jnp.arange(n, dtype=jnp.int32),
                                                              width)])
    cand_depth = jnp.concatenate([tree.depths, jnp.repeat(tree.depths + 1, width)])
    key = jnp.where(cand_valid, cand_score, -jnp.inf)

    sel = jnp.argsort(-key, stable=True)[:n]  # best N, ties to the lower index
    keep = cand_valid[sel] & (key[sel] > -jnp.inf)
    sel = sel[jnp.argsort(jnp.where(keep, sel, sel + key.shape[0]))]  # kept first, by index
    keep = cand_valid[sel] & (key[sel] > -jnp.inf)
    new_index = jnp.full(key.shape, -1, jnp.int32).at[sel].set(
        jnp.where(keep, jnp.arange(n, dtype=jnp.int32), -1))
    old_parent = cand_parent[sel]
    parents = jnp.where(keep & (old_parent >= 0), new_index[jnp.maximum(old_parent, 0)], -1)
    return DraftTree(
        tokens=jnp.where(keep, cand_token[sel], 0),
        parents=parents,
        depths=jnp.where(keep, cand_depth[sel], 0),
        scores=jnp.where(keep, key[sel], -jnp.inf),
        valid=keep,
        ancestors=ancestor_matrix(parents, max_depth),
    )


@functools.partial(jax.jit, static_argnames=("width", "max_depth"))
def regrow_trees(tree: DraftTree, cond_logits, *, width: int, max_depth: int) -> DraftTree:
    """Batched re-growth: tree fields [B, N], cond_logits [B, N, V] -> refined [B, N] tree."""
    logp = jax.nn.log_softmax(cond_logits.astype(jnp.float32), axis=-1)
    grow = functools.partial(_regrow, width=width, max_depth=max_depth)
    return jax.vmap(grow)(tree, logp)


def refine_trees(dparams, dcfg: DraftConfig, tparams, tcfg: ModelConfig, cache: KVCache,
                 tree: DraftTree, *, width: int, kernels: Kernels = Kernels()) -> DraftTree:
    """The path-conditioned pass and re-growth of a batch of first-pass trees (same size N).
    cache: the draft context the first pass used; its length must leave 2N free slots."""
    cond = conditional_logits(dparams, dcfg, tparams, tcfg, cache, tree, kernels=kernels)
    return regrow_trees(tree, cond, width=width, max_depth=dcfg.depth)
