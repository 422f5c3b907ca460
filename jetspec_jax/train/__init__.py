"""Draft-head training: data.py (self-distillation shards) -> head_forward.py (many blocks per
sequence in one pass) -> loss.py (KL to the target) -> trainer.py; features.py caches the
target's taps and top-K teacher once (`TrainConfig.feature_dir`); head_kinds.py holds the kinds
of head the trainer knows (the block heads, and any registered beside them)."""
