"""bench/results_io.py: result files are written whole or not at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import results_io  # noqa: E402


def test_write_json_replaces_whole_and_leaves_no_temp(tmp_path):
    path = tmp_path / "deeper" / "result.json"
    results_io.write_json(path, {"rows": [1, 2]})
    results_io.write_json(path, {"rows": [1, 2, 3]})
    assert json.loads(path.read_text()) == {"rows": [1, 2, 3]}
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "result.json"
    results_io.write_json(path, {"rows": [1]})
    with pytest.raises(TypeError):
        results_io.write_json(path, {"rows": [object()]})  # not JSON: fails before the rename
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_resume_appends_the_command_or_starts_fresh(tmp_path):
    path = tmp_path / "r.json"
    fresh = results_io.resume(path, "run 1", {"rows": []})
    assert fresh == {"rows": [], "command": "run 1", "commands": ["run 1"]}
    assert results_io.resume(None, "run 1", {"rows": []}) == fresh
    results_io.write_json(path, {"command": "run 0", "rows": [1]})  # before commands were kept
    assert results_io.resume(path, "run 1", {})["commands"] == ["run 0", "run 1"]
    results_io.write_json(path, {"command": "run 1", "commands": ["run 0", "run 1"], "rows": [1]})
    resumed = results_io.resume(path, "run 2", {"rows": []})
    assert resumed["rows"] == [1] and resumed["commands"] == ["run 0", "run 1", "run 2"]


@pytest.mark.parametrize("flags", [None, "--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/a b"])
def test_command_line_is_relative_and_keeps_xla_flags(monkeypatch, flags):
    script = Path(results_io.ROOT) / "bench" / "bench_decode.py"
    monkeypatch.setattr(sys, "argv", [str(script), "jax", "--out", "x y.json"])
    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    line = results_io.command_line()
    want = "python bench/bench_decode.py jax --out 'x y.json'"
    assert line == (want if flags is None else
                    "XLA_FLAGS='--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/a b' " + want)
