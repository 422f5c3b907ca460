"""Loading a target and a draft head (any supported format), and prompt files: the first
half of the Python API (`jetspec_jax.api` re-exports every public name here)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jetspec_jax.draft.head import DraftConfig, draft_specs
from jetspec_jax.draft.ngram import NgramConfig
from jetspec_jax.draft.tree_spec import TreeSpec
from jetspec_jax.io import cache, convert
from jetspec_jax.io.checkpoints import CheckpointError, load_target_checkpoint, save_target
from jetspec_jax.io.prompts import read_prompt_file  # noqa: F401  (re-exported)
from jetspec_jax.io.sources import (  # noqa: F401  (CHECKPOINT_DIRS, default_draft_path: the same)
    CHECKPOINT_DIRS, default_draft_path, read_json_object)
from jetspec_jax.io.tokenizer import Tokenizer
from jetspec_jax.model import layout, sharding
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.params import target_specs
from jetspec_jax.options import DEFAULT_MODEL, DTYPE_NAMES, MAX_BUDGET, NGRAM_DRAFT, NGRAM_LEN

DTYPES = {name: getattr(jnp, name) for name in DTYPE_NAMES}


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


TREE_FIELDS = {"budget", "width", "ngram"}  # what a head's card may set per machine


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    dcfg: DraftConfig
    params: dict
    path: str | None = None
    # The tree measured fastest with this head at batch 1, per machine ("h200", "cpu"):
    # {"budget", "width", "ngram"} or some of them, from its metadata's "evaluation";
    # `api.decoding_options` decodes with them where the caller gives none.
    best_tree: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


def resolve_dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def load_target(source: str | Path = DEFAULT_MODEL, *, dtype="float32",
                progress: bool = True, mesh=None, fuse: bool | None = None,
                use_cache: bool | None = None) -> Target:
    """Our checkpoint dir, an HF dir, a .gguf file or an embedded name (see
    `jetspec_jax.io.convert.read_target`) -> Target, weights cast to dtype.

    mesh: None (one device), a spec such as "tp=2" or a `Mesh`: the weights are sharded over
    it (`jetspec_jax.model.sharding`); our checkpoints are read straight into the shards.
    fuse: the fused weight layout (`jetspec_jax.model.layout`: q/k/v and gate/up each one matmul).
    None: on one GPU, where it is faster per token (docs/benchmarks.md); not with a mesh.
    use_cache: convert an HF, GGUF or embedded source once into the user's cache
    (`jetspec_jax.io.cache`) and read that copy from then on; None: unless JETSPEC_NO_CACHE=1.
    JAX's compilation cache is switched on here too (unless JETSPEC_NO_COMPILE_CACHE=1)."""
    cache.enable_compile_cache()
    mesh, dtype = sharding.as_mesh(mesh), resolve_dtype(dtype)
    if fuse is None:
        fuse = mesh is None and jax.default_backend() == "gpu"
    if fuse and mesh is not None:
        raise ValueError("fuse=True needs one device: a sharded q/k/v concatenation would mix "
                         "q's heads with k's (load with fuse=False)")
    with _reading(source):
        ours = (Path(source) / "metadata.json").exists()
        cached = None
        if (not ours and (cache.targets_on() if use_cache is None else use_cache)
                and cache.convertible(source)):
            cached = cache.target_path(source, jnp.dtype(dtype).name)
        converted = None
        if cached is not None and not (cached / "metadata.json").exists():
            converted = convert.read_target(source, dtype, progress=progress)
            if _keep(cached, *converted, source, progress):
                converted = None  # read back below: arrays placed as a checkpoint's are, so
                #                   the compiled programs' keys match every later run's
        if converted is None and (ours or cached is not None):
            cfg, params, tokenizer = load_target_checkpoint(cached or source, dtype=dtype,
                                                            sharding=mesh)
        else:
            cfg, params, tokenizer = converted or convert.read_target(source, dtype,
                                                                      progress=progress)
            if mesh is not None:
                params = sharding.shard_params(params, target_specs(cfg), mesh)
    if fuse:  # in place: each layer's separate weights are freed once concatenated
        params = layout.fuse_projections(params, in_place=True)
    return Target(cfg, params, tokenizer, cfg.name, str(source), mesh)


def _keep(path: Path, cfg, params, tokenizer, source, progress: bool) -> bool:
    """Writes a converted target into the cache -> whether it is there now. A full or
    read-only disk costs only the conversion next time; another process writing the same
    entry first is fine."""
    try:
        save_target(path, params, cfg, tokenizer=tokenizer, metadata={"source": str(source)})
    except FileExistsError:
        return True
    except OSError as e:
        print(f"note: could not keep the converted {source} in the cache: {e}", file=sys.stderr)
        return False
    if progress:
        print(f"note: converted {source} into {path}; later loads read it from there "
              "(jetspec cache ls / clear)", file=sys.stderr)
    return True


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


def read_draft(path: str | Path, *, dtype=None) -> Draft:
    """A draft head (our format or the reference's HF-style format) on its own, not yet checked
    against a target: small, so the CLI reads it before the target and a broken one fails fast.
    dtype: None keeps the stored one. "ngram": `ngram_draft()`."""
    from jetspec_jax.io import heads as head_io  # imported on use: the speculative path only

    if str(path) == NGRAM_DRAFT:
        return ngram_draft()
    with _reading(path):
        dcfg, params = head_io.read_any_draft(path, dtype=dtype)
    return Draft(dcfg, params, str(path), measured_best_tree(path))


def ngram_draft(max_len: int = NGRAM_LEN) -> Draft:
    """Prompt-lookup drafting (`draft/ngram.py`): no head, no weights. Its tree is the root
    and a chain of up to max_len tokens, so that is its default budget."""
    return Draft(NgramConfig(max_len), {}, NGRAM_DRAFT,
                 {machine: {"budget": max_len + 1} for machine in ("cpu", "h200")})


def measured_best_tree(path: str | Path) -> dict[str, dict[str, int]]:
    """{machine: {"budget", "width", "ngram"}} from the "evaluation" of the head's metadata.json
    ({} without one); an older card's "best_budget" {machine: budget} reads as budgets alone."""
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    if not (root / "metadata.json").is_file():
        return {}
    evaluation = read_json_object(root / "metadata.json", "of checkpoint metadata").get(
        "evaluation", {})
    best = evaluation.get("best_tree") or {
        machine: {"budget": b} for machine, b in evaluation.get("best_budget", {}).items()}
    for machine, tree in best.items():
        ok = isinstance(tree, dict) and set(tree) <= TREE_FIELDS and all(
            isinstance(v, int) and not isinstance(v, bool) for v in tree.values())
        problems = TreeSpec.problems(tree.get("budget"), tree.get("width", 1),
                                     ngram=tree.get("ngram", 0)) if ok else []
        if not ok or problems:
            raise CheckpointError(
                f"{root}/metadata.json: evaluation.best_tree[{machine!r}] must hold whole "
                f"numbers for some of {sorted(TREE_FIELDS)} in range (budget 1..{MAX_BUDGET}), "
                f"got {tree!r}" + (f": {'; '.join(problems)}" if problems else ""))
    return {machine: dict(tree) for machine, tree in best.items()}


def fit_draft(draft: Draft, target: Target, *, mesh=None) -> Draft:
    """draft checked against target and sharded like it over mesh (default: the target's)."""
    check_fits(draft, target)
    mesh = target.mesh if mesh is None else sharding.as_mesh(mesh)
    if mesh is None or not draft.params:
        return draft
    params = sharding.shard_params(draft.params, draft_specs(draft.dcfg), mesh)
    return dataclasses.replace(draft, params=params)


def load_draft(path: str | Path, target: Target, *, mesh=None) -> Draft:
    """A draft head (our format or the reference's HF-style format) checked against target,
    sharded like it over mesh (default: the target's)."""
    return fit_draft(read_draft(path, dtype=target.dtype), target, mesh=mesh)


def check_fits(draft: Draft, target: Target) -> None:
    """The head config's check (`check_target`), its error naming which head and which
    target."""
    try:
        draft.dcfg.check_target(target.cfg)
    except ValueError as e:
        where = f"head {draft.path or '<in memory>'}, target {target.source or target.name}"
        raise ValueError(f"{e} ({where})") from None
