"""bench/project_speedup.py: tau from compare_heads cells, projections from round costs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import project_speedup  # noqa: E402


def test_projection_table(tmp_path: Path, capsys) -> None:
    rounds = {"rows": [dict(model="m", batch=1, context=64, budget=b, round_over_ar=r)
                       for b, r in ((256, 2.0), (16, 1.25))] +  # out of order
                      [dict(model="m", batch=8, context=64, budget=16, round_over_ar=4.0)]}
    cell = lambda head, budget, hist: dict(head=head, budget=budget, tau_hist=hist)  # noqa: E731
    heads = {"device": "gpu", "date": "d", "cells": {
        "a": cell("jetspec", 16, [0, 1, 1]),       # 1 and 2 tokens: tau 1.5
        "b": cell("jetspec", 16, [0, 0, 0, 2]),    # pooled with a: (1 + 2 + 3 + 3) / 4 = 2.25
        "c": cell("eagle", 16, [0, 0, 4]),         # drafts depth by depth: left out
        "d": cell("dflash", 256, [0, 0, 0, 0, 1])}}
    files = {"rounds.json": rounds, "heads.json": heads}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    taus = project_speedup.measured_tau([heads])
    assert taus[("jetspec", 16)][0] == pytest.approx(2.25)
    assert ("eagle", 16) not in taus
    project_speedup.main(["--rounds", str(tmp_path / "rounds.json"), "--heads",
                          str(tmp_path / "heads.json"), "--batches", "1"])
    out = capsys.readouterr().out
    assert "| m | 1 | 64 | 16 | 1.25 | 1.25 / 3.75 | - | 2.25 -> 1.80x | - | - |" in out
    assert "| m | 1 | 64 | 256 | 2.00 | 2.00 / 6.00 | 4.00 -> 2.00x | - | 5.38x | 2.97x |" in out
    assert "| m | 8 |" not in out
    assert out.index("| m | 1 | 64 | 16 |") < out.index("| m | 1 | 64 | 256 |")  # sorted
    with pytest.raises(SystemExit, match="no result file"):
        project_speedup.main(["--rounds", str(tmp_path / "absent.json")])
