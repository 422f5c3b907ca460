"""Training-state checkpoints: `<out>/checkpoints/step_00000100/`, written by
`checkpoint.save_tree` (assembled aside and renamed, so every directory that exists is
complete), holding the head's params and optimizer state; the step, the data sampler's RNG
state and the draft config go in metadata.json. The trained head itself is saved with
`head_io.save_draft`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax

from jetspec_jax.io.checkpoints import load_tree, save_tree

STATE_KIND = "train_state"


def state_dirs(ckpt_dir: Path) -> list[Path]:
    """Complete train-state checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("step_*") if (p / "metadata.json").exists())


def save_state(ckpt_dir: Path, step: int, state, config: dict, metadata: dict, keep: int) -> Path:
    path = save_tree(ckpt_dir / f"step_{step:08d}", state, config, kind=STATE_KIND,
                     metadata={"step": step, **metadata}, overwrite=True)
    for old in state_dirs(ckpt_dir)[:-keep]:
        shutil.rmtree(old)
    return path


def restore_state(path: Path, like) -> tuple[dict, dict]:
    """-> (state shaped like `like`, metadata)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
    state, _, meta = load_tree(path, abstract, kind=STATE_KIND)
    return state, meta
