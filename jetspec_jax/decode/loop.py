"""The static settings every decoding loop shares: one frozen, hashable value passed to jit
as a static argument (as gemma's `SamplerLoop`), so the whole-loop, streaming and serving
entry points take the same thing instead of repeating its fields."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jetspec_jax.model.cache import Paging
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.options import PREFILL_CHUNK  # jax-free: the CLI reads it


@dataclasses.dataclass(frozen=True)
class Loop:
    """max_new: tokens generated per sequence at most; stop_ids: tokens that end a sequence
    (kept, then nothing more); num_slots: KV cache slots per sequence (S); kernels: which
    kernels the model runs; cache_dtype: the KV caches' dtype; prefill_chunk: prompt tokens
    per prefill pass (`autoregressive.prefill`); paging: the target's cache is paged in these
    blocks (num_slots, the logical slots per row, a whole number of them; the entry points
    then take each row's block table), None: dense.

    The sampler is not a field: the server's is per-row data (`RowSampler`), traced, while a
    batch's `Sampler` is static; each entry point takes it beside the loop."""

    max_new: int
    num_slots: int
    stop_ids: tuple[int, ...] = ()
    kernels: Kernels = Kernels()
    cache_dtype: object = jnp.float32
    prefill_chunk: int = PREFILL_CHUNK
    paging: Paging | None = None

    def __post_init__(self):  # a list of ids would not hash
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
        if self.paging is not None and self.num_slots % self.paging.block_size:
            raise ValueError(f"num_slots={self.num_slots} is not a whole number of blocks of "
                             f"{self.paging.block_size} slots")
