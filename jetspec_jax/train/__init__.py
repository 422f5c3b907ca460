"""Draft-head training: data.py (self-distillation shards) -> head_forward.py (many blocks per
sequence in one pass) -> loss.py (KL to the target) -> trainer.py; features.py caches the
target's taps and top-K teacher once (`TrainConfig.feature_dir`); eagle.py trains the EAGLE-style
baseline head (`draft/eagle.py`)."""
