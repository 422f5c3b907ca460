"""Tree verification (one target pass over all tree nodes), acceptance and commit."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.draft.tree import DraftTree
from jetspec_jax.model import target
from jetspec_jax.model.cache import KVCache, compact
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels


def verify_tree(params, cfg: ModelConfig, cache: KVCache, tree: DraftTree, *, taps=(),
                kernels: Kernels = Kernels()):
    """Runs the target over the N tree nodes of each sequence against its cached prefix.

    Node n sits at position past_len + depth[n] and sees the prefix plus its ancestors.
    Its K/V go to slot past_len + n. Returns (logits [B, N, V], cache, taps [B, N, k*D])."""
    hidden, cache, tapped = target.forward(
        params, cfg, tree.tokens, tree.positions(cache.lengths), cache, cache.lengths,
        tree.ancestors, taps=taps, kernels=kernels)
    return target.lm_head(params, cfg, hidden, kernels), cache, tapped


@flax.struct.dataclass
class Acceptance:
    path: jax.Array  # [B, P] node index at each depth of the accepted path (root first); past
    #                  the accepted depth it repeats the deepest accepted node
    count: jax.Array  # [B] accepted nodes incl. the root = tokens committed this round (tau)
    bonus: jax.Array  # [B] the target's token after the path: the next anchor

    def committed_tokens(self, tree: DraftTree):
        """[B, P]: the accepted drafts in order, then the bonus token at index count - 1."""
        drafted = jnp.take_along_axis(tree.tokens, self.path, axis=1)[:, 1:]
        drafted = jnp.pad(drafted, ((0, 0), (0, 1)))
        idx = jnp.arange(drafted.shape[1])[None, :]
        return jnp.where(idx == (self.count - 1)[:, None], self.bonus[:, None], drafted)


def accept(tree: DraftTree, target_tokens, max_depth: int) -> Acceptance:
    """Longest path the target agrees with. target_tokens [B, N]: the target's choice after each
    node (argmax for greedy, one sample per node when sampling). A node is accepted when its
    token equals its parent's target choice and every ancestor is accepted: walking from the
    root along the children whose token equals the current node's choice, as sampling needs."""
    parent_choice = jnp.take_along_axis(target_tokens, jnp.maximum(tree.parents, 0), axis=1)
    match = tree.valid & ((tree.tokens == parent_choice) | (tree.parents < 0))  # [B, N]
    accepted = ~jnp.any(tree.ancestors & ~match[:, None, :], axis=-1)  # [B, N]
    best = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)  # [B]
    on_path = jnp.take_along_axis(tree.ancestors, best[:, None, None], axis=1)[:, 0]  # [B, N]
    depth_ids = jnp.arange(max_depth + 1)[None, :, None]  # [1, P, 1]
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == depth_ids)  # [B, P, N]
    path = jnp.where(jnp.any(at_depth, axis=-1), jnp.argmax(at_depth, axis=-1), best[:, None])
    count = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0] + 1
    bonus = jnp.take_along_axis(target_tokens, best[:, None], axis=1)[:, 0]
    return Acceptance(path=path.astype(jnp.int32), count=count.astype(jnp.int32), bonus=bonus)


def commit(cache: KVCache, acc: Acceptance, active) -> KVCache:
    """Moves the accepted nodes' K/V (written at past_len + node) to contiguous slots after the
    prefix; sequences that are not active keep their length."""
    start = cache.lengths
    return compact(cache, start[:, None] + acc.path, start, jnp.where(active, acc.count, 0))
