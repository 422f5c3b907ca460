"""Files written whole or not at all: a temporary file in the same folder, then an atomic
rename, so an interrupted run never leaves half a file. Imports nothing heavy (no jax): the
light bench helpers and plot scripts use it too (through bench/common/results_io.py)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Runs `write(file)` on a temporary file beside `path`, then renames it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def write_json(path: str | os.PathLike, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")


def write_dir_atomic(path: str | os.PathLike, fill: Callable[[Path], Any]) -> Path:
    """Runs `fill(dir)` on a temporary folder beside `path`, then swaps it in as `path` (an old
    one is renamed aside before it is deleted), so `path` is never half written."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    tmp.mkdir()  # not mkdtemp: its 0700 would make a shared checkpoint readable by its owner only
    try:
        fill(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.{uuid.uuid4().hex}.old")
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
