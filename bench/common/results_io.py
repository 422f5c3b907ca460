"""How the benches write their result files: whole or not at all (`jetspec_jax.io.files`: a
temporary file in the same folder, then an atomic rename), so a run cut by a time limit never
leaves half a JSON; and `resume`, which the benches with --resume share. Importing it does not
import jax."""

import json
import os
import shlex
import sys
from pathlib import Path

from jetspec_jax.io.files import write_atomic, write_json, write_text

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["command_line", "resume", "write_atomic", "write_json", "write_text"]


def command_line() -> str:
    """This run's command as typed from the repository root (`python -m bench.X ...` for a
    script of this package), led by the XLA_FLAGS it ran under: they change the compiled
    programs, so a timing without them is not reproducible."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    if script.parts[:1] == ("bench",) and script.suffix == ".py":
        launch = ["-m", ".".join(script.with_suffix("").parts)]
    else:
        launch = [str(script)]
    flags = os.environ.get("XLA_FLAGS")
    words = ["python", *launch, *sys.argv[1:]]
    return (f"XLA_FLAGS={shlex.quote(flags)} " if flags else "") + shlex.join(words)


def resume(path, command: str, fresh: dict) -> dict:
    """The results to extend: those in the file at `path` (None, or no file: `fresh`), with
    `command` appended to their "commands" (a file from before they were kept counts its
    "command")."""
    if path is None or not Path(path).is_file():
        return {**fresh, "command": command, "commands": [command]}
    result = json.loads(Path(path).read_text())
    earlier = result.get("commands") or ([result["command"]] if "command" in result else [])
    result["commands"] = earlier + [command]
    return result
