"""How the benches write their result files: whole or not at all (`jetspec_jax.files`: a
temporary file in the same folder, then an atomic rename), so a run cut by a time limit never
leaves half a JSON. Importing it does not import jax."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # uninstalled on the GPU machine
from jetspec_jax.files import write_atomic, write_json, write_text  # noqa: E402

__all__ = ["write_atomic", "write_json", "write_text"]
