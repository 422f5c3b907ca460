"""Tuning knobs of the split-K decode attention kernel. `decode_config` takes a tuned entry
from `tuned_<device>.json` in this folder when one matches (see `common.tuned_config`)."""

import dataclasses
from pathlib import Path

from pallas_kernels import common

_HERE = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """block_h: padded rows (the G query heads of one KV head; >= 16 for the tensor-core dot).
    block_k: KV slots per inner step. num_splits: split-K factor (None: automatic, so that
    B * K * splits covers the GPU about twice); min_blocks_per_split bounds it from above."""

    block_h: int = 16
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    min_blocks_per_split: int = 4


def decode_config(group: int, head_dim: int, *, batch: int = 1, kv_len: int | None = None,
                  dtype=None) -> DecodeConfig:
    """The tuned entry for the shape if there is one (needs kv_len and dtype), else the
    heuristic."""
    tuned = common.tuned_config(common.tuned_path(_HERE), DecodeConfig, kernel="decode",
                                batch=batch, t=1, group=group, head_dim=head_dim,
                                kv_len=kv_len, dtype=dtype)
    if tuned is not None:
        return tuned
    block_h = max(16, 1 << (group - 1).bit_length())
    if head_dim > 128:
        return DecodeConfig(block_h=block_h, block_k=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_h=block_h, block_k=64, num_warps=4, num_stages=3)
