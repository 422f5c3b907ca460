"""The bench package's pure-Python helpers, without a model: result files written whole and
resumed (`bench.common.results_io`), the reports and plots made from result files
(`compare_heads`, `plot_heads`, `plot_drafting`) and the speedup projection."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import compare_heads, plot_drafting, plot_heads, project_speedup
from bench.common import results_io

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
    want = "python -m bench.bench_decode jax --out 'x y.json'"
    assert line == (want if flags is None else
                    "XLA_FLAGS='--xla_gpu_autotune_level=0 --xla_dump_to=/tmp/a b' " + want)


def cell(bench: str, head: str, hist: list[int]) -> dict:
    return dict(benchmark=bench, head=head, budget=16, tau=0.0, tau_hist=hist, identical=2,
                num_prompts=2, seconds=1.0, compile_s=2.0)


def test_markdown_keeps_cells_of_benchmarks_a_later_run_did_not_ask_for():
    args = dict(temperature=0.0, width=7, max_new_tokens=8, per_benchmark=0, one_batch=False,
                benchmarks=["mtbench"])  # the last invocation's; humaneval came before
    cells = {"mtbench/jetspec/16": cell("mtbench", "jetspec", [0, 2, 2]),
             "humaneval/jetspec/16": cell("humaneval", "jetspec", [0, 0, 2])}
    result = dict(args=args, backend="cpu", machine="x", date="d", model="m",
                  command="second", commands=["first", "second"], head_paths={"jetspec": "p"},
                  cells=cells)
    text = compare_heads.markdown(result)
    rows = [line for line in text.splitlines() if line.startswith("| humaneval")
            or line.startswith("| mtbench")]
    assert [r.split(" | ")[0] for r in rows] == ["| humaneval", "| mtbench"]  # BENCHMARKS order
    # Pooled over both benchmarks' rounds: (1*2 + 2*2 + 2*2) tokens / 6 rounds
    assert "| jetspec | 1.67 | 4/4 |" in text
    assert "commands (in order; each resumed the last): `first`, `second`" in text


def test_in_batches_splits_in_order_and_merges():
    calls = []

    def run(prompts):  # stands in for run_autoregressive: a dict of lists and seconds
        calls.append(list(prompts))
        return {"tokens": [[len(p)] for p in prompts], "prompt_lens": [len(p) for p in prompts],
                "seconds": 1.5, "compile_s": 0.5}

    prompts = ["a", "bb", "ccc", "dddd", "eeeee"]
    merged = compare_heads.in_batches(run, prompts, 2)
    assert calls == [["a", "bb"], ["ccc", "dddd"], ["eeeee"]]
    assert merged == {"tokens": [[1], [2], [3], [4], [5]], "prompt_lens": [1, 2, 3, 4, 5],
                      "seconds": 4.5, "compile_s": 1.5}
    as_tuple = compare_heads.in_batches(lambda ps: ([[0]] * len(ps), [[1]] * len(ps), 2.0, 1.0),
                                        prompts, 4)
    assert as_tuple == ([[0]] * 5, [[1]] * 5, 4.0, 2.0)
    calls.clear()
    assert compare_heads.in_batches(run, prompts, 0)["seconds"] == 1.5 and len(calls) == 1


def test_stored_ar_is_reused_only_for_the_same_batch_and_sampler():
    ar = {"tokens": [[1, 2], [3]], "max_new": 8}  # a greedy run of an older file: no temperature
    assert compare_heads.reusable_ar(ar, 2, 8, 0.0)
    assert not compare_heads.reusable_ar(ar, 2, 8, 1.0)  # a sampled run needs its own AR
    assert not compare_heads.reusable_ar(ar, 3, 8, 0.0)
    assert not compare_heads.reusable_ar(ar, 2, 16, 0.0)
    assert not compare_heads.reusable_ar(None, 2, 8, 0.0)
    assert compare_heads.reusable_ar(dict(ar, temperature=1.0), 2, 8, 1.0)


def test_speedup_is_throughput_over_ar():
    greedy = dict(tokens=100, seconds=2.0, ar_seconds=3.0)  # older files: no ar_tokens
    assert compare_heads.speedup(greedy) == 1.5
    sampled = dict(tokens=100, seconds=2.0, ar_seconds=3.0, ar_tokens=120)
    assert abs(compare_heads.speedup(sampled) - 50 / 40) < 1e-12
    assert compare_heads.speedup(dict(tokens=1, seconds=1.0, ar_seconds=None)) is None


def test_a_bfloat16_run_does_not_resume_float32_cells():
    old = {"cells": {"humaneval/jetspec/16": {}}}  # written before --dtype: float32
    assert compare_heads.other_dtype(old, "bfloat16") == "float32"
    assert compare_heads.other_dtype(old, "float32") is None
    assert compare_heads.other_dtype({**old, "dtype": "bfloat16"}, "bfloat16") is None
    assert compare_heads.other_dtype({"cells": {}}, "bfloat16") is None  # nothing to mix


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


def _row(bench: str, mode: str, budget: int, tau: float, tps: float, **extra) -> dict:
    return dict(benchmark=bench, mode=mode, budget=budget, tau=tau, mean_nodes=budget,
                tokens_per_s=tps, ar_tokens_per_s=100.0, speedup=tps / 100.0, identical=True,
                **extra)


def test_round_time_means_and_png(tmp_path: Path, capsys) -> None:
    old = {"device": "cpu", "date": "2026-11-30", "model": "m",
           "command": "python -m bench.bench_drafting --draft h --per-benchmark 4 --budgets 8",
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


def test_a_run_at_another_eagle_depth_is_refused_before_loading(tmp_path, monkeypatch):
    """Cells of one EAGLE depth never mix with another's; a depth below 1 is refused by name."""
    out = tmp_path / "heads.json"
    monkeypatch.setattr(sys, "argv", ["compare_heads", "--eagle-depth", "0", "--out", str(out)])
    with pytest.raises(SystemExit):
        compare_heads.main()
    out.write_text(json.dumps({"args": {"eagle_depth": 4}, "cells": {"a/eagle/16": {}}}))
    monkeypatch.setattr(compare_heads.api, "load_target", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr(sys, "argv", ["compare_heads", "--heads", "eagle", "--eagle-depth", "8",
                                      "--out", str(out)])
    with pytest.raises(SystemExit, match="another --eagle-depth"):
        compare_heads.main()


def test_eval_head_pools_batch1_rows_by_time_and_rounds():
    """The pooled batch-1 row is total AR time over total speculative time, tau over all
    rounds, not a mean of the sets' ratios."""
    from bench.eval_head import pooled

    rows = [dict(budget=4, prompts=2, tokens=100, seconds=2.0, ar_seconds=4.0, rounds=50,
                 tau=2.0, identical_share=1.0),
            dict(budget=4, prompts=1, tokens=300, seconds=2.0, ar_seconds=12.0, rounds=60,
                 tau=5.0, identical_share=0.0)]
    row = pooled(rows)
    assert row["speedup"] == 4.0 and row["tokens_per_s"] == 100.0
    assert row["tau"] == (2.0 * 50 + 5.0 * 60) / 110
    assert row["identical_share"] == 2 / 3 and row["prompts"] == 3
