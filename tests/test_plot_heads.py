"""bench/plot_heads.py: pooled tau, speedup from runs or cells, and the PNG it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plot_heads  # noqa: E402


def _cell(bench: str, head: str, budget: int, hist: list[int], ar: float | None) -> dict:
    return dict(benchmark=bench, head=head, budget=budget, tau_hist=hist, seconds=2.0,
                ar_seconds=ar, num_prompts=2)


def test_plot_heads_writes_png_and_pools_tau(tmp_path: Path) -> None:
    greedy = {"backend": "gpu", "device": "NVIDIA H200", "date": "2026-11-29",
              "args": {"temperature": 0.0},
              "cells": {f"{b}/{h}/{n}": _cell(b, h, n, [0, 2, 1] if b == "a" else [0, 1, 0, 1], 1.0)
                        for b in ("a", "b") for h in ("jetspec", "eagle") for n in (16, 64)},
              "runs": {f"all/{h}/{n}": dict(batch="all", head=h, budget=n, seconds=4.0,
                                            ar_seconds=1.0) for h in ("jetspec", "eagle")
                       for n in (16, 64)}}
    sampled = {"backend": "cpu", "date": "2026-11-29", "args": {"temperature": 1.0},
               "cells": {"a/dflash/16": _cell("a", "dflash", 16, [0, 2, 1], None)}}
    files = []
    for name, result in (("greedy.json", greedy), ("sampled.json", sampled)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(result))
    out = tmp_path / "img" / "heads.png"
    plot_heads.main([str(f) for f in files] + ["--out", str(out)])
    assert out.exists() and out.stat().st_size > 0

    assert plot_heads.pooled_tau([[0, 2, 1]]) == pytest.approx(4 / 3)
    s = plot_heads.summarize(greedy)[("jetspec", 16)]
    # pooled: (2*1 + 1*2 + 1*1 + 1*3) / (3 + 2) = 8/5, not the mean of the taus 4/3 and 2
    assert s["tau"] == pytest.approx(8 / 5) and s["n_bench"] == 2
    assert s["speedup"] == pytest.approx(0.25)  # from "runs", not the cells' 1.0 / 2.0
    assert plot_heads.summarize(sampled)[("dflash", 16)]["speedup"] is None
    assert plot_heads.default_label(sampled) == "CPU T=1"
