"""Prefix-filled training blocks: the head learns to draft a slot given true tokens before it.

The path-conditioned pass (`path_draft.py`) shows the head blocks whose first slots hold real
tokens (a tree path) followed by MASK. Plain training only shows [anchor, MASK, ..., MASK].
Here the block anchored at a has its slots 1..f replaced by the true tokens at positions
a+1..a+f (f = `fill`, per block, drawn by `sample_fill`); slots 1..f are not supervised (each
would see its own token), slots f+1..blk-1 are, exactly as before. The forward is
`head_forward.head_logits(..., fill=fill)` (fill = 0 gives the plain blocks, tested equal);
`loss.head_loss(prefix_fill=p)` draws the fill and masks the loss with `supervised`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.draft import head as draft_head
from jetspec_jax.draft.head import DraftConfig
from jetspec_jax.model import target


def sample_fill(key, shape, block_size: int, prob: float):
    """fill [*shape] int32: with probability prob a block gets a prefix of f true tokens,
    f uniform in 1..blk-2 (at least one slot stays supervised), else f = 0."""
    if block_size < 3 or prob <= 0:
        return jnp.zeros(shape, jnp.int32)
    k_on, k_len = jax.random.split(key)
    length = jax.random.randint(k_len, shape, 1, block_size - 1, jnp.int32)
    return jnp.where(jax.random.uniform(k_on, shape) < prob, length, 0)


def supervised(fill, depth: int):
    """fill [B, A] -> [B, A, depth] bool: slot d (1-based) is supervised when d > fill."""
    return jnp.arange(1, depth + 1)[None, None, :] > fill[:, :, None]


def filled_block_inputs(dparams, dcfg: DraftConfig, tparams, tokens, anchors, fill):
    """Embeddings [B, A*blk, D] of the blocks [anchor, t_{a+1}, ..., t_{a+f}, MASK, ...]."""
    b, a = anchors.shape
    blk = dcfg.block_size
    pos = anchors[:, :, None] + jnp.arange(blk, dtype=jnp.int32)  # [B, A, blk]
    true = jnp.take_along_axis(tokens, jnp.clip(pos, 0, tokens.shape[1] - 1).reshape(b, -1),
                               axis=1).reshape(b, a, blk)
    x = draft_head.block_inputs(dparams, dcfg, tparams, true[:, :, 0].reshape(b * a))
    x = x.reshape(b, a, blk, -1)
    use_true = jnp.arange(blk)[None, None, :] <= fill[:, :, None]  # slot 0 is the anchor anyway
    x = jnp.where(use_true[..., None], target.embed(tparams, true).astype(x.dtype), x)
    return x.reshape(b, a * blk, -1)

