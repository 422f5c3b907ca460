"""Loading a target and a draft head (any supported format), and prompt files: the first
half of the Python API (`jetspec_jax.api` re-exports every public name here)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jetspec_jax.draft.head import DraftConfig, draft_specs
from jetspec_jax.io import convert
from jetspec_jax.io.checkpoints import CheckpointError, load_target_checkpoint
from jetspec_jax.io.tokenizer import Tokenizer
from jetspec_jax.model import layout, sharding
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.params import target_specs

DEFAULT_MODEL = "smollm2-135m"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Where shipped heads live: the repository's checkpoints/ (editable install), or the package's.
CHECKPOINT_DIRS = (Path(__file__).resolve().parents[2] / "checkpoints",
                   Path(__file__).resolve().parents[1] / "checkpoints")


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer | None
    name: str  # the model's name (cfg.name): what its default draft head is named after
    source: str = ""  # what it was loaded from
    mesh: jax.sharding.Mesh | None = None  # the devices its weights are sharded over

    @property
    def dtype(self):
        return self.params["embed"].dtype


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    dcfg: DraftConfig
    params: dict
    path: str | None = None


def resolve_dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def load_target(source: str | Path = DEFAULT_MODEL, *, dtype="float32",
                progress: bool = True, mesh=None, fuse: bool | None = None) -> Target:
    """Our checkpoint dir, an HF dir, a .gguf file or an embedded name (see
    `jetspec_jax.io.convert.load_target`) -> Target, weights cast to dtype.

    mesh: None (one device), a spec such as "tp=2" or a `Mesh`: the weights are sharded over
    it (`jetspec_jax.model.sharding`); our checkpoints are read straight into the shards, other
    formats are read whole, then sharded.
    fuse: the fused weight layout (`jetspec_jax.model.layout`: q/k/v and gate/up each one matmul).
    None: on one GPU, where it measured 6% faster per token; not with a mesh."""
    mesh, dtype = sharding.as_mesh(mesh), resolve_dtype(dtype)
    if fuse is None:
        fuse = mesh is None and jax.default_backend() == "gpu"
    if fuse and mesh is not None:
        raise ValueError("fuse=True needs one device: a sharded q/k/v concatenation would mix "
                         "q's heads with k's (load with fuse=False)")
    with _reading(source):
        if mesh is not None and (Path(source) / "metadata.json").exists():
            cfg, params, tokenizer = load_target_checkpoint(source, dtype=dtype, sharding=mesh)
        else:
            cfg, params, tokenizer = convert.load_target(source, dtype, progress=progress)
            if mesh is not None:
                params = sharding.shard_params(params, target_specs(cfg), mesh)
    if fuse:  # in place: each layer's separate weights are freed once concatenated
        params = layout.fuse_projections(params, in_place=True)
    return Target(cfg, params, tokenizer, cfg.name, str(source), mesh)


@contextlib.contextmanager
def _reading(source):
    """Turns orbax's failure on cut or missing array files into one CheckpointError line."""
    log = logging.getLogger("asyncio")  # orbax logs a traceback there for each unread array
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    except (ValueError, OSError):
        raise
    except Exception as e:  # orbax raises a bare Exception
        cause = e
        while cause.__cause__ is not None:  # tensorstore's own message is the telling one
            cause = cause.__cause__
        raise CheckpointError(f"{source}: cannot read the stored arrays (truncated or corrupt "
                              f"checkpoint?): {str(cause).splitlines()[0]}") from e
    finally:
        log.setLevel(level)


def default_draft_path(target_name: str) -> Path | None:
    """checkpoints/<target_name>-jetspec/ (repository or package) if it is there, else None."""
    found = [d / f"{target_name}-jetspec" for d in CHECKPOINT_DIRS]
    return next((p for p in found if p.is_dir()), None)


def load_draft(path: str | Path, target: Target, *, mesh=None) -> Draft:
    """A draft head (our format or the reference's HF-style format) checked against target,
    sharded like it over mesh (default: the target's)."""
    from jetspec_jax.io import (  # imported on use: only the speculative path needs it
        heads as head_io,
    )

    mesh = target.mesh if mesh is None else sharding.as_mesh(mesh)
    with _reading(path):
        dcfg, params = head_io.load_any_draft(path, dtype=target.dtype)
    if mesh is not None:
        params = sharding.shard_params(params, draft_specs(dcfg), mesh)
    draft = Draft(dcfg, params, str(path))
    check_fits(draft, target)
    return draft


def read_prompt_file(path: str | Path) -> list[str]:
    """One prompt per non-blank line, or for .jsonl one {"prompt": ...} object per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such prompt file: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {data[e.start]:#04x} at "
                         f"offset {e.start}); save it as UTF-8") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"prompt file {path} holds no prompts (it is empty or blank)")
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    return [_jsonl_prompt(path, n, line) for n, line in lines]


def _jsonl_prompt(path: Path, n: int, line: str) -> str:
    try:
        prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError):
        prompt = None
    if not isinstance(prompt, str):
        raise ValueError(f'{path}:{n}: expected a JSON object with a "prompt" string')
    return prompt


def check_fits(draft: Draft, target: Target) -> None:
    """One ValueError naming every way the head cannot serve the target, and which two."""
    from jetspec_jax.io import heads as head_io

    try:
        head_io.check_head_fits(draft.dcfg, target.cfg)
    except ValueError as e:
        where = f"head {draft.path or '<in memory>'}, target {target.source or target.name}"
        raise ValueError(f"{e} ({where})") from None
