"""A params tree as a few flat safetensors files: for heads that must travel as small files.

    save_shards("export/head", dparams, dcfg.to_dict(), kind="draft_head", dtype=jnp.bfloat16)
    kind, config, flat, meta = read_shards("export/head")       # or a list of the files
    params = unflatten(flat, draft_specs(DraftConfig.from_dict(config)), "head")

The native format of a head is the orbax checkpoint directory (`checkpoints.py`: what training
writes and `load_draft` reads). This second one is kept because a head must sometimes travel as
files of a bounded size (`convert --head --shard-mib`: a copy to a machine that limits each
file), which an orbax directory cannot promise; it reads back to the same tree, and loads
wherever a head does (`generate --draft`, `--init-head`).

A directory of `part-00001-of-00003.safetensors` files, each at most `max_bytes` long.
Tensors are keyed in the files by their tree path with dots ("layers.0.q"), the form exports
have always had; in memory by the "/" path every reader uses (`model.params.unflatten`).
Every file's header holds the same JSON {"kind", "config", "metadata", "num_files"}, so the
files alone (in any folder) make the whole tree. Written to a hidden sibling directory and
renamed into place.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jetspec_jax.io.checkpoints import CheckpointError
from jetspec_jax.io.files import write_dir_atomic
from jetspec_jax.model.params import flatten_params

HEADER = "jetspec_jax"
MAX_BYTES = 15 * 2**20


def save_shards(path: str | Path, tree, config: dict, *, kind: str, metadata: dict | None = None,
                dtype=None, max_bytes: int = MAX_BYTES, overwrite: bool = False) -> Path:
    """Writes tree (cast to dtype, if given) as files of at most max_bytes at directory path."""
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    flat = {k: np.asarray(x if dtype is None else x.astype(dtype))
            for k, x in _file_keys(flatten_params(jax.device_get(tree))).items()}
    header = json.dumps({"kind": kind, "config": config, "metadata": metadata or {},
                         "num_files": 0})
    fixed = 2 * len(header) + 1024  # the file header: our JSON (escaped) and tensor index
    groups, sizes = [], []
    # First fit, largest tensors first: few files (tensors are found by key, not by order).
    for k in sorted(flat, key=lambda k: -flat[k].nbytes):
        need = flat[k].nbytes + 128 + len(k)
        i = next((i for i, n in enumerate(sizes) if n + need <= max_bytes), len(groups))
        if i == len(groups):
            groups.append([])
            sizes.append(fixed)
        groups[i].append(k)
        sizes[i] += need
    too_big = [f"{k} ({x.nbytes} bytes)" for k, x in flat.items()
               if fixed + x.nbytes + 128 + len(k) > max_bytes]
    if too_big:
        raise ValueError(f"tensors too large for the {max_bytes}-byte file limit: {too_big}")
    header = header.replace('"num_files": 0}', f'"num_files": {len(groups)}}}')

    def fill(tmp: Path) -> None:
        for i, keys in enumerate(groups, 1):
            save_file({k: np.ascontiguousarray(flat[k]) for k in keys},
                      tmp / f"part-{i:05d}-of-{len(groups):05d}.safetensors",
                      metadata={HEADER: header})

    return write_dir_atomic(path, fill)


def is_shard_export(path: str | Path) -> bool:
    """Whether path (or a list of paths) is a file, or a directory holding files, written by
    `save_shards`."""
    try:
        return bool(shard_files(path))
    except (CheckpointError, FileNotFoundError):
        return False


def _header(file: Path) -> dict | None:
    try:
        with safe_open(file, framework="numpy") as f:
            text = (f.metadata() or {}).get(HEADER)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e
    return None if text is None else json.loads(text)


def shard_files(paths) -> list[Path]:
    """Directories and files -> the safetensors files among them written by `save_shards`."""
    files = []
    for p in map(Path, [paths] if isinstance(paths, (str, Path)) else paths):
        if not p.exists():
            raise FileNotFoundError(f"no head weights at {p}: no such file or directory")
        files += sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    return [f for f in files if _header(f) is not None]


def read_shards(paths) -> tuple[str, dict, dict[str, np.ndarray], dict]:
    """The files of one `save_shards` export (a directory, or the files themselves) ->
    (kind, config, {key: array}, metadata). Missing, extra or mismatched files are named."""
    files = shard_files(paths)
    if not files:
        raise CheckpointError(f"no head weight files (written by save_shards) in {paths}")
    headers = [_header(f) for f in files]
    first = headers[0]
    odd = [str(f) for f, h in zip(files, headers) if h != first]
    if odd:
        raise CheckpointError(f"{odd} belong to another export than {files[0]}")
    if len(files) != first["num_files"]:
        raise CheckpointError(f"the export has {first['num_files']} files, {len(files)} are "
                              f"given: {[f.name for f in files]}")
    flat = {}
    for f in files:
        with safe_open(f, framework="numpy") as h:
            flat.update({k.replace(".", "/"): h.get_tensor(k) for k in h.keys()})
    return first["kind"], first["config"], flat, first["metadata"]


def _file_keys(flat: dict) -> dict:
    """The files' key form: "layers/0/q" -> "layers.0.q"."""
    return {k.replace("/", "."): x for k, x in flat.items()}

