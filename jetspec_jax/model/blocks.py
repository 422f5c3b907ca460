"""Host-side allocation of a paged cache's blocks (`cache.Paging`): rows take blocks from one
free list as their length grows and give them all back when they finish, so the pool holds the
tokens in use rather than every row's longest possible length.

Between device calls a loop grows each row to what its next steps may write (an
autoregressive step writes one slot past the committed length, speculative rounds
`speculative.slots_ahead`) and puts the new `table` in the cache; on device the decoding loops
stop before a step that an unfinished row's blocks cannot hold (`KVCache.has_room`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jetspec_jax.model.cache import Paging
from pallas_kernels.paged import NULL_BLOCK


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a row asked for."""


class BlockAllocator:
    def __init__(self, paging: Paging):
        if paging.num_blocks < 2:
            raise ValueError(f"a pool needs the null block and at least one more, got "
                             f"num_blocks={paging.num_blocks}")
        self.paging = paging
        self._free = [b for b in reversed(range(paging.num_blocks)) if b != NULL_BLOCK]
        self._rows: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks(self, row: Hashable) -> tuple[int, ...]:
        """The physical blocks of row, in logical order."""
        return tuple(self._rows.get(row, ()))

    def grow(self, row: Hashable, num_slots: int) -> None:
        """Gives row blocks until they hold num_slots slots. OutOfBlocks, giving nothing, when
        too few are free."""
        have = self._rows.setdefault(row, [])
        need = -(-num_slots // self.paging.block_size) - len(have)
        if need > len(self._free):
            raise OutOfBlocks(
                f"row {row!r} needs {need} more blocks of {self.paging.block_size} slots for "
                f"{num_slots} slots; {len(self._free)} of the pool's "
                f"{self.paging.num_blocks - 1} are free: finish a row or allocate a larger pool")
        for _ in range(max(need, 0)):
            have.append(self._free.pop())

    def free(self, row: Hashable) -> None:
        """Gives row's blocks back (a row that has none: nothing)."""
        self._free.extend(reversed(self._rows.pop(row, [])))

    def table(self, rows: Sequence[Hashable], num_slots: int) -> np.ndarray:
        """int32 [len(rows), num_slots / block_size]: each row's blocks, then `NULL_BLOCK`."""
        out = np.full((len(rows), num_slots // self.paging.block_size), NULL_BLOCK, np.int32)
        for i, row in enumerate(rows):
            blocks = self.blocks(row)
            if len(blocks) > out.shape[1]:
                raise ValueError(f"row {row!r} holds {len(blocks)} blocks; a table of "
                                 f"{num_slots} slots has room for {out.shape[1]}")
            out[i, :len(blocks)] = blocks
        return out
