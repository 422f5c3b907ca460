"""One layer's paged K or V: a pool of fixed-size blocks shared by every row of a batch and a
block table mapping each row's logical blocks to physical ones. Logical slot s of row b lives
at block table[b, s // block_size], offset s % block_size, so a row's memory follows the
blocks it was given, not the longest row's length.

Cache attentions take a `Pages` where they take a dense [B, K, S, H] cache: the references
gather the rows' logical view (`logical`), the split-K decode and portable kernels read the
blocks in place through the table, a kernel that cannot declines it (`refuse`,
NotImplementedError) and the next implementation serves."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# The block an unassigned table entry names: never given to a row, so writes past a row's
# blocks (finished rows, padding) land there and reads of it are masked out.
NULL_BLOCK = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    pool: jax.Array  # [num_blocks, K, block_size, H]
    table: jax.Array  # [B, max_blocks] int32: physical block of each logical block

    @property
    def block_size(self) -> int:
        return self.pool.shape[2]

    @property
    def dtype(self):
        return self.pool.dtype

    @property
    def num_slots(self) -> int:
        """S of the rows' logical view."""
        return self.table.shape[1] * self.block_size

    def locate(self, slots):
        """Logical slots [B, T] -> (physical block, offset), each [B, T]; slots past the
        table go to `NULL_BLOCK`."""
        blocks = jnp.take_along_axis(self.table, slots // self.block_size, axis=1, mode="fill",
                                     fill_value=NULL_BLOCK)
        return blocks, slots % self.block_size


def logical(cache):
    """A dense cache [B, K, S, H] as it is; `Pages` gathered into the rows' logical view
    [B, K, max_blocks * block_size, H]."""
    if not isinstance(cache, Pages):
        return cache
    b, m = cache.table.shape
    _, k, bs, h = cache.pool.shape
    rows = cache.pool[cache.table]  # [B, max_blocks, K, block_size, H]
    return rows.transpose(0, 2, 1, 3, 4).reshape(b, k, m * bs, h)


def refuse(cache, what: str) -> None:
    """NotImplementedError for a kernel that reads dense caches only."""
    if isinstance(cache, Pages):
        raise NotImplementedError(f"the {what} reads dense KV caches, not paged ones")
