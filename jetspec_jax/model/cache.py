"""KV cache: an explicit pytree passed into each forward and returned, donated under jit.

Dense, each layer's K and V are [B, K, S, H]: every row holds S slots. Paged (`table` set),
each layer's K and V are one pool of blocks shared by every row and the table maps each row's
logical blocks to physical ones (`pallas_kernels.paged`), so a row's memory follows the blocks
it was given (`blocks.BlockAllocator`). The functions below take one layer's view of either
(`KVCache.layer`: an array, or a `Pages`), so writes, reads, compaction and attention have
one code path for both.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.paged import NULL_BLOCK, Pages

# Logical axes (see `params.ParamSpec`) of each layer's K or V and of lengths, for sharding.
KV_AXES = ("batch", "kv_heads", "cache_slots", "head_dim")  # [B, K, S, H]
POOL_AXES = ("cache_blocks", "kv_heads", "cache_slots", "head_dim")  # [blocks, K, size, H]
LENGTHS_AXES = ("batch",)  # [B]


@dataclasses.dataclass(frozen=True)
class Paging:
    """A paged cache's static shape: num_blocks blocks of block_size slots per layer, block
    `NULL_BLOCK` included (it is never a row's)."""

    block_size: int
    num_blocks: int


@flax.struct.dataclass
class KVCache:
    k: list  # per layer [B, K, S, H]; paged: [num_blocks, K, block_size, H]
    v: list  # as k
    lengths: jax.Array  # [B] int32: committed tokens per sequence
    table: jax.Array | None = None  # paged: [B, max_blocks] int32, see `Pages`

    @property
    def num_slots(self) -> int:
        return self.layer(0)[0].num_slots if self.table is not None else self.k[0].shape[2]

    def layer(self, i: int):
        """Layer i's (K, V) as attention reads them: arrays, or `Pages` through the table."""
        if self.table is None:
            return self.k[i], self.v[i]
        return Pages(self.k[i], self.table), Pages(self.v[i], self.table)

    def has_room(self, extra: int):
        """[B] bool: whether each row's blocks hold its next `extra` slots past its length
        (what the next step or round writes); None when dense (every row has S slots)."""
        if self.table is None:
            return None
        last = (self.lengths + extra - 1) // self.k[0].shape[2]  # [B] logical block
        blocks = jnp.arange(self.table.shape[1])[None, :]
        held = (self.table != NULL_BLOCK) | (blocks > last[:, None])
        return jnp.all(held, axis=1) & (last < self.table.shape[1])

    def with_layers(self, k: list, v: list) -> KVCache:
        """This cache holding the per-layer views k, v (`layer`'s, updated)."""
        unview = lambda x: x.pool if isinstance(x, Pages) else x  # noqa: E731
        return self.replace(k=[unview(x) for x in k], v=[unview(x) for x in v])

    @classmethod
    def allocate(cls, num_layers, batch, num_kv_heads, num_slots, head_dim, dtype,
                 paging: Paging | None = None, table=None):
        """Zeros; paged (paging given) the pools and table [batch, num_slots / block_size]."""
        shape = (batch, num_kv_heads, num_slots, head_dim)
        if paging is not None:
            if table is None or table.shape != (batch, num_slots // paging.block_size) or \
                    num_slots % paging.block_size:
                raise ValueError(
                    f"a paged cache of {num_slots} slots per row in blocks of "
                    f"{paging.block_size} needs a block table [{batch}, "
                    f"{num_slots // paging.block_size}] and a whole number of blocks; got "
                    f"{None if table is None else table.shape}")
            shape = (paging.num_blocks, num_kv_heads, paging.block_size, head_dim)
            table = jnp.asarray(table, jnp.int32)
        zeros = lambda: [jnp.zeros(shape, dtype) for _ in range(num_layers)]  # noqa: E731
        return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32), table=table)


def retable(tree, table):
    """tree (a decoding state) with the table of every paged cache in it replaced: how a host
    hands the blocks it gave rows between device calls (`blocks.BlockAllocator.table`) to
    both the target's cache and the drafter's, which share them."""
    is_cache = lambda x: isinstance(x, KVCache)  # noqa: E731
    return jax.tree.map(lambda x: x.replace(table=jnp.asarray(table, jnp.int32))
                        if is_cache(x) and x.table is not None else x, tree, is_leaf=is_cache)


def write_slots(layer_cache, new, start):
    """Writes new [B, T, K, H] into layer_cache ([B, K, S, H] or `Pages`) at slots
    start[b] + t.

    The caller guarantees start + T <= S (dynamic_update_slice would clamp silently); paged,
    slots in no block of the row's go to `NULL_BLOCK`."""
    if isinstance(layer_cache, Pages):
        slots = start[:, None] + jnp.arange(new.shape[1], dtype=start.dtype)  # [B, T]
        blocks, offsets = layer_cache.locate(slots)
        pool = layer_cache.pool.at[blocks, :, offsets].set(new.astype(layer_cache.dtype))
        return dataclasses.replace(layer_cache, pool=pool)
    new = new.transpose(0, 2, 1, 3).astype(layer_cache.dtype)  # [B, K, T, H]
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x, (0, s, 0)))(
        layer_cache, new, start
    )


def gather_slots(layer_cache, slots):
    """layer_cache [B, K, S, H] or `Pages`, slots [B, T] -> [B, K, T, H]."""
    if isinstance(layer_cache, Pages):
        blocks, offsets = layer_cache.locate(slots)
        return layer_cache.pool[blocks, :, offsets].transpose(0, 2, 1, 3)  # from [B, T, K, H]
    return jax.vmap(lambda c, idx: c[:, idx])(layer_cache, slots)


def compact(cache: KVCache, src_slots, start, count) -> KVCache:
    """Moves the entries at src_slots [B, T] (e.g. accepted tree nodes, in path order) to
    contiguous slots start[b] .. start[b] + T - 1 and advances lengths by count [B].

    Entries past count are copied too but stay beyond the new length, so they are never seen."""

    def move(layer_cache):
        picked = gather_slots(layer_cache, src_slots).transpose(0, 2, 1, 3)  # [B, T, K, H]
        return write_slots(layer_cache, picked, start)

    views = [cache.layer(i) for i in range(len(cache.k))]
    return cache.with_layers([move(k) for k, _ in views], [move(v) for _, v in views]).replace(
        lengths=cache.lengths + count.astype(jnp.int32))


def copy_blocks(dst: KVCache, src: KVCache, table) -> KVCache:
    """src's rows (paged, their blocks in a pool of their own, shaped as dst's) with the blocks
    `table` names copied into dst's pools: how rows started apart join a shared pool.
    `NULL_BLOCK` entries copy one null block onto the other, which nothing reads."""
    put = lambda d, x: d.at[table].set(x[table])  # noqa: E731
    return src.replace(k=[put(d, x) for d, x in zip(dst.k, src.k)],
                       v=[put(d, x) for d, x in zip(dst.v, src.v)])
