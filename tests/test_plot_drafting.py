"""bench/plot_drafting.py: time per round, means over benchmarks, batch size, the PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plot_drafting  # noqa: E402


def _row(bench: str, mode: str, budget: int, tau: float, tps: float, **extra) -> dict:
    return dict(benchmark=bench, mode=mode, budget=budget, tau=tau, mean_nodes=budget,
                tokens_per_s=tps, ar_tokens_per_s=100.0, speedup=tps / 100.0, identical=True,
                **extra)


def test_round_time_means_and_png(tmp_path: Path, capsys) -> None:
    old = {"device": "cpu", "date": "2026-11-30", "model": "m",
           "command": "bench/bench_drafting.py --draft h --per-benchmark 4 --budgets 8",
           "rows": [_row("a", "per_depth", 8, 2.0, 80.0), _row("b", "per_depth", 8, 1.0, 40.0),
                    _row("a", "path", 8, 3.0, 60.0)]}
    new = {"device": "NVIDIA H200", "date": "2026-11-30", "model": "m", "command": "x",
           "rows": [_row("a", "adaptive", 16, 1.5, 300.0, batch=2)]}
    s = plot_drafting.summarize(old)
    # batch 4 from the command: 1e3 * 4 * 2 / 80 = 100 ms and 1e3 * 4 * 1 / 40 = 100 ms
    assert s["per_depth", 8]["round_ms"] == pytest.approx(100.0)
    assert s["per_depth", 8]["tau"] == pytest.approx(1.5)
    assert s["per_depth", 8]["n_bench"] == 2 and s["path", 8]["n_bench"] == 1
    assert plot_drafting.summarize(new)["adaptive", 16]["round_ms"] == pytest.approx(10.0)
    files = []
    for name, result in (("old.json", old), ("new.json", new)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(result))
    out = tmp_path / "img" / "drafting.png"
    plot_drafting.main([str(f) for f in files] + ["--out", str(out)])
    assert out.exists() and out.stat().st_size > 0
    assert "| 8 | path | 3.00 |" in capsys.readouterr().out


def test_missing_file_and_label_count(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no result file"):
        plot_drafting.main([str(tmp_path / "absent.json")])
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"rows": [_row("a", "path", 8, 2.0, 50.0, batch=1)]}))
    with pytest.raises(SystemExit, match="1 files but 2 labels"):
        plot_drafting.main([str(f), "--labels", "x", "y", "--out", str(tmp_path / "p.png")])
