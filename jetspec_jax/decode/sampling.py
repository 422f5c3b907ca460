"""Temperature / top-k / top-p sampling, shared by autoregressive and speculative decoding.

Both decoders turn target logits into tokens through `choose_tokens`, so speculative
sampling draws from exactly the distribution autoregressive sampling draws from.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampler:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits, sampler: Sampler):
    """logits [..., V] float32 -> tempered logits with filtered-out tokens at -inf."""
    logits = logits.astype(jnp.float32) / sampler.temperature
    if sampler.top_k:
        kth = jax.lax.top_k(logits, sampler.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampler.top_p < 1.0:
        logits = _top_p(logits, jnp.sort(logits, axis=-1)[..., ::-1], sampler.top_p)
    return logits


def _top_p(logits, sorted_logits, top_p):
    """Keeps the smallest prefix (by rank) whose mass reaches top_p: a token stays if the mass
    of the tokens ranked above it is still below top_p. sorted_logits: logits, descending."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


@flax.struct.dataclass
class RowSampler:
    """Sampling options per sequence, for a batch whose rows are different requests (the
    server's slots): arrays [B]; temperature 0 means greedy for that row. With a RowSampler the
    decoding state's key is [B], one random stream per row, so a row's samples do not depend on
    its neighbours."""

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32, 0: off
    top_p: jax.Array  # [B] float32, 1: off

    def rows(self, start: int, stop: int) -> "RowSampler":
        return jax.tree.map(lambda x: x[start:stop], self)


def _choose_rows(keys, logits, rows: RowSampler):
    """keys [B], logits [B, ..., V] -> [B, ...]: each row greedy or sampled with its options."""
    greedy = greedy_tokens(logits)

    def sample(key, lg, temperature, top_k, top_p):  # one row: lg [..., V]
        lg = lg.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
        ranked = jnp.sort(lg, axis=-1)[..., ::-1]
        kth = jnp.take(ranked, jnp.maximum(top_k, 1) - 1, axis=-1)[..., None]
        lg = jnp.where((top_k > 0) & (lg < kth), -jnp.inf, lg)
        lg = _top_p(lg, jnp.sort(lg, axis=-1)[..., ::-1], top_p)
        return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)

    def sampled():
        drawn = jax.vmap(sample)(keys, logits, rows.temperature, rows.top_k, rows.top_p)
        is_greedy = (rows.temperature == 0).reshape((-1,) + (1,) * (greedy.ndim - 1))
        return jnp.where(is_greedy, greedy, drawn)

    # An all-greedy batch (the common case) skips the sorts over the vocabulary.
    return jax.lax.cond(jnp.all(rows.temperature == 0), lambda: greedy, sampled)


def greedy_tokens(logits):
    """logits [..., V] -> the first index of each row's max, int32 (jnp.argmax's answer).

    On a mesh the logits are split over the vocabulary, and XLA's argmax all-gathers each
    shard's (max, index) pair. Profiled on two GPUs, those two tiny NCCL all-gathers took
    most of a batch-1 step, while the layers' all-reduces cost next to nothing.
    So on a mesh: an all-reduce of the max, then one of the smallest index holding it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == top, index, logits.shape[-1]), axis=-1)


def choose_tokens(key, logits, sampler: Sampler | RowSampler):
    """logits [..., V] -> tokens [...] int32 (argmax when greedy, else a sample). A key per
    row (key [B], logits [B, ..., V]) gives each row its own stream: a row's sample then does
    not depend on the batch it is decoded in. A RowSampler takes such keys, and options per
    row."""
    if isinstance(sampler, RowSampler):
        return _choose_rows(key, logits, sampler)
    if sampler.greedy:
        return greedy_tokens(logits)
    if key.ndim:
        return jax.vmap(lambda k, x: choose_tokens(k, x, sampler))(key, logits)
    return jax.random.categorical(key, filtered_logits(logits, sampler), axis=-1).astype(jnp.int32)


def split_key(key):
    """(next key, subkey) of a key, or of each row's key [B]."""
    if key.ndim:
        return tuple(jax.vmap(jax.random.split)(key).swapaxes(0, 1))
    return tuple(jax.random.split(key))
