"""Tuning knobs of the split-K decode attention kernel."""

import dataclasses


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


def decode_config(group: int, head_dim: int) -> DecodeConfig:
    block_h = max(16, 1 << (group - 1).bit_length())
    if head_dim > 128:
        return DecodeConfig(block_h=block_h, block_k=32, num_warps=4, num_stages=2)
    return DecodeConfig(block_h=block_h, block_k=64, num_warps=4, num_stages=3)
