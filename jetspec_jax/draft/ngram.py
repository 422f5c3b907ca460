"""Context n-gram drafting (prompt lookup): the tokens that followed the latest earlier
occurrence of the committed text's suffix, drafted as a chain from the root of the round's tree.

Per row, on device, with static shapes: `lookup` finds the longest suffix (n = MAX_N down to 1)
of the prompt + committed tokens that occurred before in them, at its latest occurrence, and
returns up to L tokens that followed it. `add_chain` merges that chain into a drafted tree: a
chain token equal to a child of the chain's previous node reuses that node, the rest become
new nodes. The budget is shared, chain first: the root and the chain's nodes (reused or new)
are nodes 0..len(chain), then the tree's other nodes fill what is left in their own
(best-first) order, so the merged tree keeps `budget` nodes and every parent before its
children. Verification is unchanged, so decoding stays lossless.

`NgramDrafter` (config `NgramConfig`) drafts the chain alone: prompt-lookup decoding with no
head and no weights. `TreeSpec.ngram` adds the chain to any head's tree (`context_chain`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetspec_jax.draft import drafter
from jetspec_jax.draft.tree import DraftTree, ancestor_matrix, root_trees

MAX_N = 4  # the longest suffix looked up


def history(state) -> tuple[jax.Array, jax.Array]:
    """The committed text of each row: (tokens [B, S], lengths [B]), the prompt
    (`state.prompt`, padded to S slots) followed by the output so far (`state.out`)."""
    prompt, plen, out = state.prompt, state.prompt_lens, state.out
    i = jnp.arange(prompt.shape[1])[None, :]  # [1, S]
    j = jnp.clip(i - plen[:, None], 0, out.tokens.shape[1] - 1)
    tokens = jnp.where(i < plen[:, None], prompt, jnp.take_along_axis(out.tokens, j, axis=1))
    return tokens, plen + out.num_tokens


def lookup(tokens, length, max_len: int) -> tuple[jax.Array, jax.Array]:
    """tokens [B, S] (the first `length` [B] valid) -> (chain [B, max_len], count [B]): the
    tokens after the latest earlier occurrence of the longest suffix of n <= MAX_N tokens
    that occurred before; count 0 when even the last token never occurred before."""
    s = tokens.shape[1]
    i = jnp.arange(s)[None, :]  # [1, S]: where an earlier occurrence ends
    run = jnp.zeros(tokens.shape, jnp.int32)  # [B, S]: its matched suffix length
    alive = i < (length - 1)[:, None]  # it ends before the last token: something follows
    for k in range(MAX_N):  # the suffix's k-th token from the end against tokens[i - k]
        last = jnp.take_along_axis(tokens, jnp.maximum(length - 1 - k, 0)[:, None], axis=1)
        back = jnp.pad(tokens, ((0, 0), (k, 0)), constant_values=-1)[:, :s]  # -1: before 0
        alive = alive & (back == last)
        run = run + alive
    key = jnp.where(run > 0, run * s + i, -1)  # longest match, then the latest
    best = jnp.argmax(key, axis=1)  # [B]
    found = jnp.max(key, axis=1) >= 0
    idx = jnp.minimum(best[:, None] + 1 + jnp.arange(max_len)[None, :], s - 1)
    count = jnp.where(found, jnp.minimum(max_len, length - 1 - best), 0)
    return jnp.take_along_axis(tokens, idx, axis=1), count.astype(jnp.int32)


def _merge_one(tree: DraftTree, chain, count, max_depth: int) -> DraftTree:
    """One row (fields [N]) with chain [L], count valid: the module docstring's merge."""
    n, length = tree.tokens.shape[0], chain.shape[0]
    idx = jnp.arange(n)
    node, on, matched, last_score = jnp.int32(0), jnp.bool_(True), jnp.int32(0), jnp.float32(0)
    in_path = jnp.zeros(n, bool)
    for k in range(length):  # walk the chain down the tree while a child holds its token
        hit = tree.valid & (tree.parents == node) & (tree.tokens == chain[k])
        on = on & hit.any() & (k < count)
        node = jnp.where(on, jnp.argmax(hit).astype(jnp.int32), node)
        in_path = in_path | (on & (idx == node))
        matched = matched + on
        last_score = jnp.where(on, tree.scores[node], last_score)
    # New indices: root 0, a reused node its depth, the others after the chain, in order;
    # index n is where dropped nodes go.
    rest = tree.valid & ~in_path & (idx > 0)
    rest_at = count + 1 + jnp.cumsum(rest) - rest
    new = jnp.where(idx == 0, 0, jnp.where(in_path, tree.depths,
                                           jnp.where(rest & (rest_at < n), rest_at, n)))
    new_parent = jnp.where(tree.parents >= 0, new[jnp.maximum(tree.parents, 0)], -1)
    fresh = (jnp.arange(length) >= matched) & (jnp.arange(length) < count)  # new chain nodes
    at = jnp.concatenate([new, jnp.where(fresh, jnp.arange(1, length + 1), n)])  # [N + L]

    def put(head, links, pad):
        vals = jnp.concatenate([head, links.astype(head.dtype)])
        return jnp.full(n + 1, pad, head.dtype).at[at].set(vals)[:n]

    parents = put(new_parent, jnp.arange(length), -1)
    return DraftTree(
        tokens=put(tree.tokens, chain, 0),
        parents=parents,
        depths=put(tree.depths, jnp.arange(1, length + 1), 0),
        scores=put(tree.scores, jnp.full(length, last_score), -jnp.inf),
        valid=put(tree.valid, jnp.ones(length, bool), False),
        ancestors=ancestor_matrix(parents, max_depth),
    )


def add_chain(tree: DraftTree, chain, count, max_depth: int) -> DraftTree:
    """Batched trees [B, N] and chains [B, L] (count [B] valid, L <= min(max_depth, N - 1))
    -> the merged trees [B, N]. New chain nodes carry the score of their deepest reused
    ancestor (the draft gave them no probability)."""
    if chain.shape[1] > min(max_depth, tree.tokens.shape[1] - 1):
        raise ValueError(f"a chain of {chain.shape[1]} tokens does not fit trees of "
                         f"{tree.tokens.shape[1]} nodes and depth {max_depth}")
    return jax.vmap(lambda t, c, k: _merge_one(t, c, k, max_depth))(tree, chain, count)


def round_chain(state, max_len: int, max_depth: int, budget: int):
    """The round's context chain (chain [B, L], count [B]) for trees of `budget` nodes and
    `max_depth` depths, L = min(max_len, max_depth, budget - 1); None when L < 1."""
    length = min(max_len, max_depth, budget - 1)
    return lookup(*history(state), length) if length >= 1 else None


def fills_tree(chain, count, budget: int, active) -> jax.Array | None:
    """Whether every active row's chain takes all `budget` nodes but the root, leaving a
    drafted tree no node (`add_chain` places the chain first): a traced bool, or None when a
    chain of this length never can."""
    if chain.shape[1] != budget - 1:
        return None
    return jnp.all((count >= budget - 1) | ~active)


def context_chain(tree: DraftTree, state, max_len: int, max_depth: int) -> DraftTree:
    """The round's tree with the context chain of up to max_len tokens added (capped by the
    tree's size and depth)."""
    found = round_chain(state, max_len, max_depth, tree.tokens.shape[1])
    return tree if found is None else add_chain(tree, *found, max_depth)


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Prompt-lookup drafting: chains of up to max_len tokens, no weights."""

    max_len: int = 8

    def __post_init__(self):
        if self.max_len < 1:
            raise ValueError(f"n-gram chain length must be >= 1, got {self.max_len}")

    tap_layers = ()  # it reads no hidden states
    chain_only = True  # its tree is one chain: the adaptive budget's estimate does not apply

    @property
    def block_size(self) -> int:
        return self.max_len + 1

    @property
    def depth(self) -> int:
        return self.max_len

    def check_target(self, tcfg) -> None:
        """Fits any target: it has no weights and reads only token ids."""


class NgramDrafter:
    """Its tree is the context chain from the root: min(budget, max_len + 1) nodes. It keeps
    no context of its own; the committed text is in the round's state."""

    @staticmethod
    def start(dparams, dcfg: NgramConfig, tparams, prompt, prompt_lens, prompt_taps, *,
              num_slots: int, cache_dtype, paging=None, table=None):
        return None, None, jnp.zeros((prompt.shape[0],), jnp.int32)

    @staticmethod
    def draft(dparams, dcfg: NgramConfig, tparams, tcfg, state, active, *, tree_spec, kernels,
              need_tree=None):
        if tree_spec.buckets:
            raise ValueError("the n-gram drafter's tree is its chain: a fixed budget only")
        trees = root_trees(state.anchor, min(tree_spec.budget, dcfg.block_size))
        return context_chain(trees, state, dcfg.max_len, dcfg.depth), state.draft_cache


drafter.register(NgramConfig, NgramDrafter())
