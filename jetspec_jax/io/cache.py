"""The user's cache: each GGUF file or HF checkpoint converted once into our checkpoint format,
and JAX's compiled programs, so a second run neither converts nor compiles again.

    $JETSPEC_CACHE, else $XDG_CACHE_HOME/jetspec, else ~/.cache/jetspec
      targets/<name>-<dtype>-<hash>/   our checkpoint (`checkpoints.save_target`, written
                                       in a temporary directory, then renamed)
      hashes.json                      path -> [size, mtime_ns, sha256]: a file is hashed once
      xla/                             JAX's persistent compilation cache

A converted target is keyed by the SHA-256 of its source files' contents and the dtype, so an
edited or replaced file is converted again. JETSPEC_NO_CACHE=1 (CLI: --no-cache) turns the
converted targets off, JETSPEC_NO_COMPILE_CACHE=1 (--no-compile-cache) the compiled programs.
Imports nothing heavy: `jetspec cache ls` runs without JAX.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from jetspec_jax.io.files import write_json
from jetspec_jax.io.sources import EMBEDDED, embedded_path

TARGETS, HASHES, XLA = "targets", "hashes.json", "xla"
_OFF = ("1", "true", "yes", "on")


def cache_dir() -> Path:
    if os.environ.get("JETSPEC_CACHE"):
        return Path(os.environ["JETSPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "jetspec"


def targets_on() -> bool:
    return os.environ.get("JETSPEC_NO_CACHE", "").lower() not in _OFF


def compile_cache_on() -> bool:
    return os.environ.get("JETSPEC_NO_COMPILE_CACHE", "").lower() not in _OFF


# ---- content hashes ------------------------------------------------------------------------


def file_hash(path: Path) -> str:
    """SHA-256 of a file's contents, remembered by (absolute path, size, mtime) in hashes.json
    so a later call does not read the file again."""
    path = Path(path).resolve()
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    memo_file = cache_dir() / HASHES
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if (known := memo.get(str(path))) and known[:2] == stamp:
        return known[2]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    memo[str(path)] = [*stamp, digest.hexdigest()]
    try:
        write_json(memo_file, memo)
    except OSError:  # a read-only cache only costs hashing again
        pass
    return digest.hexdigest()


def convertible(source: str | Path) -> bool:
    """Whether source is an embedded name, a .gguf file or an HF checkpoint (directory or a
    file in one): what the cache keeps converted."""
    if str(source) in EMBEDDED:
        return True
    path = Path(source)
    if path.suffix == ".gguf":
        return path.is_file()
    root = path if path.is_dir() else path.parent
    return path.exists() and (root / "config.json").is_file()


def source_files(source: str | Path) -> tuple[str, list[Path]]:
    """A convertible source -> (the model's name as conversion sets it, the files it reads):
    an embedded name or a .gguf file (one file), an HF directory or a file in one (every file
    in the directory)."""
    if str(source) in EMBEDDED:
        return str(source), [embedded_path(str(source))]
    path = Path(source)
    if path.suffix == ".gguf":
        return path.stem, [path]
    root = path if path.is_dir() else path.parent
    return root.name, sorted(f for f in root.iterdir() if f.is_file())


def target_path(source: str | Path, dtype_name: str) -> Path:
    """Where the converted source lives in the cache (it may not exist yet)."""
    name, files = source_files(source)
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{file_hash(f)}\0".encode())
    return cache_dir() / TARGETS / f"{name}-{dtype_name}-{digest.hexdigest()[:16]}"


# ---- listing and clearing ------------------------------------------------------------------


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def entries() -> list[dict]:
    """The converted targets (name, source, size) and the compiled programs (count, size)."""
    root = cache_dir()
    rows = []
    for d in sorted((root / TARGETS).glob("*")) if (root / TARGETS).is_dir() else []:
        if d.name.startswith("."):  # a conversion in progress or interrupted
            continue
        try:
            source = json.loads((d / "metadata.json").read_text()).get("source", "?")
        except (OSError, ValueError):
            source = "? (incomplete)"
        rows.append(dict(kind="target", path=str(d), source=source, bytes=_size(d)))
    xla = root / XLA
    if xla.is_dir():
        programs = [f for f in xla.iterdir() if f.is_file()]
        rows.append(dict(kind="compiled", path=str(xla), count=len(programs),
                         bytes=sum(f.stat().st_size for f in programs)))
    return rows


def clear() -> int:
    """Deletes the converted targets, the remembered hashes and the compiled programs ->
    bytes freed. Other files in the directory are left alone."""
    root, freed = cache_dir(), 0
    for name in (TARGETS, HASHES, XLA):
        path = root / name
        if path.exists():
            freed += _size(path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return freed


# ---- compiled programs ---------------------------------------------------------------------


def enable_compile_cache() -> Path | None:
    """Points JAX's persistent compilation cache at cache_dir()/xla (unless turned off), with
    no minimum compile time or entry size, so the CPU's programs are kept too. Call it before
    anything compiles. -> the directory, or None when off."""
    if not compile_cache_on():
        return None
    import jax

    path = cache_dir() / XLA
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
