"""Converting HF and GGUF checkpoints into ours, and loading a target from any of them.

    convert("path/to/Qwen3-8B", "checkpoints/qwen3-8b", dtype=jnp.bfloat16)
    cfg, params, tokenizer = read_target("smollm2-135m", jnp.float32)
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jetspec_jax.io.checkpoints import load_target_checkpoint, save_target
from jetspec_jax.io.convert.common import ConversionError
from jetspec_jax.io.convert.hf import is_hf_checkpoint, load_hf
from jetspec_jax.io.sources import ACCEPTED as _ACCEPTED, EMBEDDED, embedded_path
from jetspec_jax.io.tokenizer import Tokenizer
from jetspec_jax.model.config import ModelConfig

__all__ = ["ConversionError", "EMBEDDED", "convert", "read_target", "embedded_path"]


def read_checkpoint(source: str | Path, *, dtype=jnp.bfloat16, progress: bool = True
                    ) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """An HF checkpoint, a GGUF file or an embedded name -> (cfg, params, tokenizer or None)."""
    name = None
    if str(source) in EMBEDDED:
        name, source = str(source), embedded_path(str(source))
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory; expected {_ACCEPTED}")
    if path.suffix == ".gguf":
        from jetspec_jax.io.convert.gguf import load_gguf  # gguf is needed for GGUF files only

        cfg, params = load_gguf(path, dtype=dtype, name=name, progress=progress)
        return cfg, params, Tokenizer.from_gguf(path)
    if is_hf_checkpoint(path) or (path / "config.json").exists():
        cfg, params = load_hf(path, dtype=dtype, progress=progress)
        root = path if path.is_dir() else path.parent
        tokenizer = Tokenizer.from_hf_dir(root) if (root / "tokenizer.json").exists() else None
        return cfg, params, tokenizer
    raise ConversionError(f"cannot tell what {path} is; expected {_ACCEPTED}")


def convert(src: str | Path, dst: str | Path, *, dtype=jnp.bfloat16, overwrite: bool = False,
            progress: bool = True) -> Path:
    """Converts src (see `read_checkpoint`) into our checkpoint at dst, tokenizer included.

    Nothing is written at dst unless the whole conversion succeeds."""
    cfg, params, tokenizer = read_checkpoint(src, dtype=dtype, progress=progress)
    return save_target(dst, params, cfg, tokenizer=tokenizer, overwrite=overwrite,
                       metadata={"source": str(src)})


def read_target(source: str | Path, dtype=jnp.bfloat16, *, progress: bool = True
                ) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Our checkpoint dir, an HF dir, a .gguf file or an embedded name -> (cfg, params,
    tokenizer). The tokenizer is None only for an HF checkpoint without tokenizer.json."""
    path = Path(source)
    if path.is_dir() and (path / "metadata.json").exists():
        return load_target_checkpoint(path, dtype=dtype)
    return read_checkpoint(source, dtype=dtype, progress=progress)
