"""KV cache: an explicit pytree passed into each forward and returned, donated under jit."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

# Logical axes (see `params.ParamSpec`) of each layer's K or V and of lengths, for sharding.
KV_AXES = ("batch", "kv_heads", "cache_slots", "head_dim")  # [B, K, S, H]
LENGTHS_AXES = ("batch",)  # [B]


@flax.struct.dataclass
class KVCache:
    k: list  # per layer [B, K, S, H]
    v: list  # per layer [B, K, S, H]
    lengths: jax.Array  # [B] int32: committed tokens per sequence

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def allocate(cls, num_layers, batch, num_kv_heads, num_slots, head_dim, dtype):
        shape = (batch, num_kv_heads, num_slots, head_dim)
        zeros = lambda: [jnp.zeros(shape, dtype) for _ in range(num_layers)]  # noqa: E731
        return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32))


def write_slots(layer_cache, new, start):
    """Writes new [B, T, K, H] into layer_cache [B, K, S, H] at slots start[b] + t.

    The caller guarantees start + T <= S (dynamic_update_slice would clamp silently)."""
    new = new.transpose(0, 2, 1, 3).astype(layer_cache.dtype)  # [B, K, T, H]
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x, (0, s, 0)))(
        layer_cache, new, start
    )


def gather_slots(layer_cache, slots):
    """layer_cache [B, K, S, H], slots [B, T] -> [B, K, T, H]."""
    return jax.vmap(lambda c, idx: c[:, idx])(layer_cache, slots)


def compact(cache: KVCache, src_slots, start, count) -> KVCache:
    """Moves the entries at src_slots [B, T] (e.g. accepted tree nodes, in path order) to
    contiguous slots start[b] .. start[b] + T - 1 and advances lengths by count [B].

    Entries past count are copied too but stay beyond the new length, so they are never seen."""

    def move(layer_cache):
        picked = gather_slots(layer_cache, src_slots).transpose(0, 2, 1, 3)  # [B, T, K, H]
        return write_slots(layer_cache, picked, start)

    return KVCache(
        k=[move(c) for c in cache.k],
        v=[move(c) for c in cache.v],
        lengths=cache.lengths + count.astype(jnp.int32),
    )
