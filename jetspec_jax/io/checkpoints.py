"""Our checkpoints: an orbax pytree of arrays beside its config, written atomically.

A checkpoint directory holds
  config.json     the config dict of what the tree is (`ModelConfig.to_dict()` for a target)
  metadata.json   {"kind", "format", "dtypes", ...caller's fields}; written last
  params/         the arrays (orbax)
  tokenizer/      optional, `Tokenizer.save` format
It is assembled in a hidden sibling directory and renamed into place, so a failure leaves
nothing at the destination. `save_tree` / `load_tree` are generic (the draft head uses them
too); `save_target` / `load_target_checkpoint` add the target's config and shape checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jetspec_jax.io.files import write_dir_atomic
from jetspec_jax.io.sources import FORMAT, CheckpointError, read_info  # noqa: F401 (re-exported)
from jetspec_jax.model.config import ConfigError, ModelConfig
from jetspec_jax.model.params import check_params, target_specs
from jetspec_jax.model.sharding import param_shardings

PARAMS_DIR, TOKENIZER_DIR = "params", "tokenizer"


def save_tree(path: str | Path, tree, config: dict[str, Any], *, kind: str,
              metadata: dict[str, Any] | None = None,
              extra: Callable[[Path], None] | None = None, overwrite: bool = False) -> Path:
    """Writes tree + config.json + metadata.json at path; `extra(dir)` may add files."""
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / PARAMS_DIR, tree)
        if extra is not None:
            extra(tmp)
        dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(tree)})
        info = {"kind": kind, "format": FORMAT, "dtypes": dtypes, **(metadata or {})}
        (tmp / "metadata.json").write_text(json.dumps(info, indent=1))

    return write_dir_atomic(path, fill)


def carried_metadata(path: str | Path, kind: str) -> dict:
    """The metadata of the checkpoint at path (e.g. its training settings) that a converted
    copy keeps: all but what the writer records afresh (kind, format, dtypes)."""
    return {k: v for k, v in read_info(path, kind)[1].items()
            if k not in ("kind", "format", "dtypes")}


def stored_shapes(path: str | Path):
    """The stored tree with orbax ArrayMetadata leaves (shape, dtype), nothing read."""
    try:
        with ocp.StandardCheckpointer() as ckptr:
            item = ckptr.metadata(Path(path).absolute() / PARAMS_DIR).item_metadata
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the stored arrays' metadata: {e}") from e
    return getattr(item, "tree", item)


def load_tree(path: str | Path, abstract=None, *, kind: str | None = None):
    """-> (tree, config dict, metadata dict).

    abstract: a tree of `jax.ShapeDtypeStruct` (with shardings, for a sharded restore) that
    the stored tree must match; None restores every array as stored. Leaves without a sharding
    go to the default device: never to the device recorded at save time, so a checkpoint
    written on a GPU loads on a CPU-only machine.
    """
    path = Path(path).absolute()
    config, meta = read_info(path, kind)
    if abstract is None:
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                stored_shapes(path))
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: x if x.sharding is not None else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                        sharding=here), abstract)
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(path / PARAMS_DIR, abstract)
    return tree, config, meta


def save_target(path: str | Path, params, cfg: ModelConfig, *, tokenizer=None,
                metadata: dict[str, Any] | None = None, overwrite: bool = False) -> Path:
    check_params(params, target_specs(cfg), "params to save")
    extra = None if tokenizer is None else (lambda d: tokenizer.save(d / TOKENIZER_DIR))
    return save_tree(path, params, cfg.to_dict(), kind="target", metadata=metadata,
                     extra=extra, overwrite=overwrite)


def load_target_checkpoint(path: str | Path, *, dtype=None, sharding=None):
    """-> (cfg, params, tokenizer or None).

    dtype casts every array on restore; sharding is one `jax.sharding.Sharding` for all arrays,
    a tree of them shaped like the params, or a `Mesh` (`sharding.param_shardings` places each
    array by its logical axes). Each device then reads only its own shard from disk.
    """
    path = Path(path).absolute()
    config, _ = read_info(path, "target")
    try:
        cfg = ModelConfig.from_dict(config)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}/config.json is not a valid model config: {e}") from e
    shapes = stored_shapes(path)
    check_params(shapes, target_specs(cfg), f"checkpoint {path}")
    if isinstance(sharding, jax.sharding.Mesh):
        sharding = param_shardings(target_specs(cfg), sharding)

    def leaf(m, s=None):
        return jax.ShapeDtypeStruct(m.shape, dtype or m.dtype, sharding=s)

    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        abstract = jax.tree.map(lambda m: leaf(m, sharding), shapes)
    else:
        abstract = jax.tree.map(leaf, shapes, sharding)
    params, _, _ = load_tree(path, abstract, kind="target")
    tokenizer = None
    if (path / TOKENIZER_DIR).is_dir():
        from jetspec_jax.io.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(path / TOKENIZER_DIR)
    return cfg, params, tokenizer

