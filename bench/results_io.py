"""How the benches write their result files: whole or not at all (a temporary file in the same
folder, then an atomic rename), so a run cut by a time limit never leaves half a JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | os.PathLike, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")
