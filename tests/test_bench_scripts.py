"""The GPU benchmark scripts run end to end on a tiny model on the CPU, so a script bug is found
here rather than on the GPU. Their numbers here mean nothing. Every script of the package at
least imports (`python -m bench.X` is how they run)."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(module: str, *argv: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_bench_speculative_rounds_and_phases(tmp_path, monkeypatch, capsys):
    out = tmp_path / "spec.json"
    run_script("bench.bench_speculative", "--skip-check", "--model", "tiny-dense",
               "--batches", "1", "--phase-batches", "1", "--budgets", "8", "--contexts", "64",
               "--dump-hlo", str(tmp_path / "hlo"), "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["budget"] == 8
    # Times are differences of a long and a short loop: on a busy 2-core CPU a tiny model's
    # microsecond phases can come out slightly negative, so only their presence is checked.
    assert all(math.isfinite(row[k]) for k in ("round_ms", "ar_step_ms", "draft_ms", "tree_ms",
                                               "verify_ms", "accept_commit_ms"))
    assert {p.name for p in (tmp_path / "hlo").iterdir()} == {
        "ar_tiny-dense_b1_s64.hlo.txt.gz", "round8_tiny-dense_b1_s64.hlo.txt.gz"}

    # --resume keeps the row and times only the missing budget.
    run_script("bench.bench_speculative", "--skip-check", "--model", "tiny-dense",
               "--batches", "1", "--phase-batches", "--budgets", "8", "4", "--contexts", "64",
               "--resume", "--out", str(out))
    result = json.loads(out.read_text())
    assert [r["budget"] for r in result["rows"]] == [8, 4] and result["rows"][0] == row
    assert len(result["commands"]) == 2 and "--resume" in result["commands"][1]
    assert result["layout"] == "separate"

    # Rows of one weight layout are not resumed under the other: refused before any model is
    # made, so this run needs no process of its own.
    from bench import bench_speculative

    monkeypatch.setattr(sys, "argv", ["bench_speculative.py", "--skip-check", "--model",
                                      "tiny-dense", "--layout", "fused", "--resume", "--out",
                                      str(out)])
    with pytest.raises(SystemExit) as done:
        bench_speculative.main()
    assert done.value.code == 2
    assert "holds rows of the separate layout, not fused" in capsys.readouterr().err
    assert json.loads(out.read_text()) == result


def test_bench_moe_verify_tiny(tmp_path):
    out = tmp_path / "moe.json"
    run_script("bench.bench_moe_verify", "--tiny", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    checked = [r for r in rows if r["impl"] == "pallas"]
    assert checked and all(r["rel_err"] < 1e-5 for r in checked)


def test_bench_stream_quick(tmp_path):
    """Streamed and whole-loop decoding timed side by side (the script checks their tokens)."""
    out = tmp_path / "stream.json"
    run_script("bench.bench_stream", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["chunk"]) for r in rows] == [
        ("speculative", "whole"), ("speculative", 2), ("autoregressive", "whole"),
        ("autoregressive", 2)]
    assert rows[3]["calls"] == 1 + 7 // 2 + 1 and rows[1]["calls"] == 1 + -(-rows[1]["rounds"] // 2)
    assert all(r["seconds"] > 0 and r["tokens"] == 8 for r in rows)


def test_every_bench_script_imports():
    """Each script imports its helpers as `bench.common...` and the model code as installed, so
    a renamed function anywhere they reach fails here, without running a bench."""
    names = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
    assert {"bench_decode", "bench_speculative", "compare_heads"} <= set(names)
    for name in names:
        assert callable(importlib.import_module(f"bench.{name}").main), name


def test_training_logs_read_from_metrics_and_training_records(tmp_path):
    """A metrics.jsonl and a training record (.json, its log under run.log) give the same rows."""
    from bench.plot_training import read_log
    rows = [{"step": 10, "loss": 1.5}, {"step": 20, "loss": 1.2, "eval": {"tau": 2.0, "kl": [1.0]}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    (tmp_path / "record.json").write_text(json.dumps({"note": "n", "run": {"log": rows}}))
    assert read_log(str(tmp_path / "metrics.jsonl")) == rows == read_log(str(tmp_path / "record.json"))


def test_training_plot_takes_an_evaluation_off_the_log_interval(tmp_path, monkeypatch):
    """An evaluation at a step that is not a log step is a row without a loss: still plotted."""
    from bench import plot_training
    rows = [{"step": 10, "loss": 1.5}, {"step": 15, "eval": {"tau": 2.0, "kl": [1.0, 1.4]}},
            {"step": 20, "loss": 1.2}]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "curves.png"
    monkeypatch.setattr(sys, "argv", ["plot_training", str(log), "--out", str(out)])
    plot_training.main()
    assert out.stat().st_size > 0


def test_long_run_curve_splits_stretches_by_their_start_step(tmp_path):
    """A resumed run's clock goes on across stretches: each stretch still gets its own rows,
    data and training seconds, and the GPU minutes count every stretch's data generation."""
    from bench.long_run_curve import summary
    ev = {"tau": 3.0, "kl": [0.5], "acc": [0.7]}
    rows = [{"step": 10, "time": 5.0, "step_s": 0.5}, {"step": 20, "time": 10.0, "eval": ev},
            {"step": 30, "time": 70.0, "step_s": 0.5}, {"step": 40, "time": 130.0, "eval": ev}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for seed, seconds in ((1000, 60.0), (1020, 120.0)):  # stretches from steps 0 and 20
        (tmp_path / f"data-seed{seed}.json").write_text(json.dumps({
            "settings": {"seed": seed}, "num_seqs": 2, "num_tokens": 9,
            "generation": {"seconds": seconds}}))
    result = summary(tmp_path)
    assert [s["logged_steps"] for s in result["stretches"]] == [[10, 20], [30, 40]]
    assert [s["train_s"] for s in result["stretches"]] == [10.0, 120.0]
    assert [p["gpu_minutes"] for p in result["heldout"]] == [round(70 / 60, 2),
                                                             round(310 / 60, 2)]
    assert result["gpu_minutes"] == round(310 / 60, 2)


def test_train_step_times_each_head_setting_without_a_data_set(tmp_path):
    """bench.train_step --synthetic: a preset's shapes with random weights and sequences, the
    step timed per --target-attention and --head-attention, one row each in the result file; a
    variant this machine cannot run (cuDNN's attention without a GPU) is a row with its error,
    and the others still run."""
    from bench import train_step
    out = tmp_path / "step.json"
    train_step.main(["--synthetic", "32", "--model", "tiny-dense", "--batch", "2", "--anchors",
                     "4", "--anchor-chunk", "4", "--head-layers", "1", "--steps", "1",
                     "--vocab", "16", "--no-online", "--target-attention", "reference", "auto",
                     "--head-attention", "auto", "cudnn",
                     "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["target_attention"], r["head_attention"], r["draft_vocab"])  # auto: XLA's here
            for r in rows] == [(target, attn, 16) for target in ("reference", "auto")
                               for attn in ("reference", "cudnn")]
    for r in rows:
        if r["head_attention"] == "cudnn":
            assert "needs a GPU" in r["error"] and "step_s" not in r
        else:
            assert r["step_s"] > 0 and 0 < r["coverage"] <= 1


def test_trace_summary_reads_the_host_xla_ops_on_the_cpu():
    """On the CPU the ops are the Eigen threads' events, without the executor's wrappers (which
    span them and would count twice); a GPU process keeps every op it has."""
    from bench.trace_summary import summarise

    def meta(kind, pid, tid, name):
        return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}

    def op(pid, tid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    events = [meta("process_name", 1, 0, "/host:CPU"),
              meta("process_name", 2, 0, "/device:GPU:0"),
              meta("thread_name", 1, 5, "tf_XLAEigen/12"), meta("thread_name", 1, 6, "python"),
              op(1, 5, "ThunkExecutor::Execute", 0, 100), op(1, 5, "dot.3", 10, 40),
              op(1, 5, "copy.1", 60, 20), op(1, 5, "dot.3", 80, 10), op(1, 6, "jit_step", 0, 100),
              op(2, 0, "fusion.7", 0, 30)]
    cpu = summarise(events, "CPU")["/host:CPU"]
    assert cpu["ops"] == [("dot.3", 50, 2), ("copy.1", 20, 1)]
    assert (cpu["busy_us"], cpu["span_us"]) == (70, 80)
    assert summarise(events)["/device:GPU:0"]["ops"] == [("fusion.7", 30, 1)]
