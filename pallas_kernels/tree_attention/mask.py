"""Compact (bit-packed) form of the T x T block mask, as the kernels read it.

Row t of the block mask (which of the T block keys query t sees) is stored as
ceil(T / 32) uint32 words: bit (j % 32) of word j // 32 is block_mask[t, j]. A tree
verification block of 256 nodes thus costs 32 bytes per query instead of a dense
S-long (or even T-long) mask.
"""

import jax
import jax.numpy as jnp

WORD_BITS = 32


def num_words(num_queries: int) -> int:
    return -(-num_queries // WORD_BITS)


def pack_block_mask(block_mask):
    """bool [B, T, T] -> uint32 [B, T, ceil(T/32)] (bit j % 32 of word j // 32)."""
    b, t, t2 = block_mask.shape
    if t != t2:
        raise ValueError(f"block_mask must be [B, T, T], got {block_mask.shape}")
    w = num_words(t)
    m = jnp.pad(block_mask.astype(jnp.uint32), ((0, 0), (0, 0), (0, w * WORD_BITS - t)))
    m = m.reshape(b, t, w, WORD_BITS)
    shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    return jnp.sum(m << shifts, axis=-1, dtype=jnp.uint32)


def unpack_block_mask(words, num_queries: int):
    """uint32 [B, T, W] -> bool [B, T, num_queries]."""
    shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    bits = (words[..., None] >> shifts) & jnp.uint32(1)  # [B, T, W, 32]
    bits = bits.reshape(*words.shape[:-1], words.shape[-1] * WORD_BITS)
    return bits[..., :num_queries].astype(bool)


def causal_block_mask(batch: int, num_queries: int):
    t = jnp.arange(num_queries)
    return jnp.broadcast_to(t[None, :, None] >= t[None, None, :], (batch, num_queries, num_queries))


def is_packed(block_mask) -> bool:
    return block_mask is not None and block_mask.dtype == jnp.uint32


def as_packed(block_mask):
    """Accepts a bool [B, T, T] mask or an already packed uint32 [B, T, W] one."""
    return block_mask if is_packed(block_mask) else pack_block_mask(block_mask)


def as_dense(block_mask, num_queries: int):
    """Accepts a bool [B, T, T] mask or a packed uint32 [B, T, W] one; None stays None."""
    if block_mask is None or not is_packed(block_mask):
        return block_mask
    return unpack_block_mask(block_mask, num_queries)


def row_block_extent(words, num_queries: int, group: int, block_rows: int, num_row_blocks: int):
    """For rows packed as r = t * group + g, the number of block keys a row block must visit:
    1 + the largest j set in any of its rows' masks (0 if none). int32 [B, num_row_blocks].

    Tree masks are lower triangular, so early row blocks skip most of the block keys."""
    dense = unpack_block_mask(words, num_queries)  # [B, T, T]
    j = jnp.arange(num_queries, dtype=jnp.int32)
    last = jnp.max(jnp.where(dense, j[None, None, :] + 1, 0), axis=-1)  # [B, T]
    rows = jnp.arange(num_row_blocks * block_rows, dtype=jnp.int32)
    t_of_row = jnp.minimum(rows // group, num_queries - 1)
    valid = rows < num_queries * group
    per_row = jnp.where(valid[None, :], last[:, t_of_row], 0)  # [B, Rp]
    return jnp.max(per_row.reshape(-1, num_row_blocks, block_rows), axis=-1).astype(jnp.int32)


def causal_row_block_extent(num_queries: int, group: int, block_rows: int, row_block):
    """Causal analogue of `row_block_extent` for one (traced) row block index."""
    last_row = (row_block + 1) * block_rows - 1
    return jnp.minimum(last_row // group + 1, num_queries)
