"""The GPU benchmark scripts run end to end on a tiny model on the CPU, so a script bug is found
here rather than in a call that spends device time. Their numbers here mean nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(*argv: str) -> None:
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_bench_speculative_rounds_and_phases(tmp_path):
    out = tmp_path / "spec.json"
    run_script("bench/bench_speculative.py", "--skip-check", "--model", "tiny-dense",
               "--batches", "1", "--phase-batches", "1", "--budgets", "8",
               "--dump-hlo", str(tmp_path / "hlo"), "--out", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["budget"] == 8
    # Times are differences of a long and a short loop: on a busy 2-core CPU a tiny model's
    # microsecond phases can come out slightly negative, so only their presence is checked.
    assert all(math.isfinite(row[k]) for k in ("round_ms", "ar_step_ms", "draft_ms", "tree_ms",
                                               "verify_ms", "accept_commit_ms"))
    assert {p.name for p in (tmp_path / "hlo").iterdir()} == {
        "ar_tiny-dense_b1_s1024.hlo.txt.gz", "round8_tiny-dense_b1_s1024.hlo.txt.gz"}

    # --resume keeps the row and times only the missing budget.
    run_script("bench/bench_speculative.py", "--skip-check", "--model", "tiny-dense",
               "--batches", "1", "--phase-batches", "--budgets", "8", "4", "--resume",
               "--out", str(out))
    result = json.loads(out.read_text())
    assert [r["budget"] for r in result["rows"]] == [8, 4] and result["rows"][0] == row
    assert len(result["commands"]) == 2 and "--resume" in result["commands"][1]
    assert result["layout"] == "separate"

    # Rows of one weight layout are not resumed under the other.
    done = subprocess.run([sys.executable, "bench/bench_speculative.py", "--skip-check",
                           "--model", "tiny-dense", "--layout", "fused", "--resume",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2 and "holds rows of the separate layout, not fused" in done.stderr
    assert json.loads(out.read_text()) == result


def test_bench_moe_verify_tiny(tmp_path):
    out = tmp_path / "moe.json"
    run_script("bench/bench_moe_verify.py", "--tiny", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    checked = [r for r in rows if r["impl"] == "pallas"]
    assert checked and all(r["rel_err"] < 1e-5 for r in checked)


def test_compile_probe_compiles_each_setting_in_its_own_process(tmp_path):
    out = tmp_path / "probe.json"
    run_script("bench/compile_probe.py", "--model", "tiny-dense", "--batch", "2",
               "--prompt-len", "8", "--budget", "8", "--max-new", "4",
               "--settings", "default", "no_triton_gemm", "bfloat16", "--out", str(out))
    result = json.loads(out.read_text())
    assert [r["setting"] for r in result["rows"]] == ["default", "no_triton_gemm", "bfloat16"]
    for row in result["rows"]:
        assert "error" not in row, row
        for program in ("spec_b8", "ar"):
            assert row[program]["compile_s"] > 0 and row[program]["stablehlo_lines"] > 100
    assert result["rows"][1]["xla_flags"] == "--xla_gpu_enable_triton_gemm=false"
    assert [r["dtype"] for r in result["rows"]] == ["float32", "float32", "bfloat16"]


def test_fused_gemv_table_takes_the_fastest_timed_config_and_skips_untimed_groups():
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_fused_gemv

    def row(group, impl, us, block_k):
        return {"group": group, "M": 1, "impl": impl, "us": us, "config": {"block_k": block_k}}

    rows = [row("norm+qkv", "xla", 1.0, None), row("norm+qkv", "pallas", float("nan"), 16),
            row("norm+qkv", "pallas", 5.0, 32), row("norm+qkv", "pallas", 3.0, 64),
            row("norm+qkv", "pallas", 4.0, 128), row("down+res", "xla", 2.0, None),
            row("down+res", "pallas", float("nan"), 16)]
    table = bench_fused_gemv.best_table(rows, bench_fused_gemv.QUICK_GROUPS, "cpu")
    (entry,) = table["entries"]
    assert (entry["group"], entry["config"], entry["us"]) == ("norm+qkv", {"block_k": 64}, 3.0)


def test_compile_probe_keeps_the_steps_a_timeout_cut():
    sys.path.insert(0, str(ROOT / "bench"))
    import compile_probe

    stdout = ('{"backend": "gpu", "setup_s": 3.0}\nnoise\n'
              '{"spec_b64": {"lower_s": 2.5, "stablehlo_lines": 900}}\n'
              '{"spec_b64": {"compile_s": 80.0}}\n{"ar": {"lower_s": 1.0, "stablehlo_lines": 5}}\n')
    row = {"setting": "default", **compile_probe.merge_lines(stdout), "error": "over 125 s"}
    assert row["spec_b64"] == {"lower_s": 2.5, "stablehlo_lines": 900, "compile_s": 80.0}
    text = compile_probe.table([row])
    assert "| float32 | 3.0 | 80.0 (2.5) | cut (1.0) | over 125 s |" in text


def test_memory_probe_shows_chunked_prefill_needs_less(tmp_path):
    out = tmp_path / "memory.json"
    run_script("bench/memory_probe.py", "--model", "tiny-dense", "--shapes", "2x200x256",
               "--prefill-chunks", "1000", "16", "--max-new", "8", "--out", str(out))
    one_pass, chunked = json.loads(out.read_text())["rows"]
    assert (one_pass["prefill_chunk"], chunked["prefill_chunk"]) == (1000, 16)
    assert 0 < chunked["temp_bytes"] < one_pass["temp_bytes"]
    assert one_pass["kv_cache_bytes"] == chunked["kv_cache_bytes"] > 0


def test_bench_fused_gemv_and_xla_flags_quick(tmp_path):
    """The fused-projection bench checks, sweeps, writes the table its decode steps read and
    times both impls; the flags driver runs it once per flag set in its own process."""
    out, table = tmp_path / "fused.json", tmp_path / "table.json"
    run_script("bench/bench_fused_gemv.py", "--quick", "--out", str(out),
               "--write-table", str(table))
    result = json.loads(out.read_text())
    assert result["checks"] and all(c["ok"] for c in result["checks"]), result["checks"]
    assert {r["impl"] for r in result["rows"]} == {"xla", "pallas"}
    # On a busy 2-core CPU a tiny kernel's time can come out nan (noise beats the loop): the
    # table holds exactly the groups with a timed kernel row, each with its fastest config.
    timed = [r for r in result["rows"] if r["impl"] == "pallas" and r.get("us", 0) > 0]
    entries = json.loads(table.read_text())["entries"]
    assert {e["group"] for e in entries} == {r["group"] for r in timed}
    for e in entries:
        best = min((r for r in timed if r["group"] == e["group"]), key=lambda r: r["us"])
        assert e["kernel"] == "fused_gemv" and e["config"] == best["config"]
    assert {(r["model"], r["matmul_impl"]) for r in result["decode"] if "ms_per_token" in r} == {
        ("tiny-dense", "xla"), ("tiny-dense", "fused_interpret"),
        ("tiny-moe", "pallas_interpret"), ("tiny-moe", "fused_interpret")}

    flags = tmp_path / "flags.json"
    run_script("bench/bench_xla_flags.py", "--quick", "--sets", "pdl", "--out", str(flags))
    (row,) = json.loads(flags.read_text())["rows"]
    assert row["rc"] == 0 and "--xla_gpu_enable_pdl=true" in row["flags"]
    assert len([r for r in row["decode"] if "ms_per_token" in r]) == 4


def test_bench_stream_quick(tmp_path):
    """Streamed and whole-loop decoding timed side by side (the script checks their tokens)."""
    out = tmp_path / "stream.json"
    run_script("bench/bench_stream.py", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["chunk"]) for r in rows] == [
        ("speculative", "whole"), ("speculative", 2), ("autoregressive", "whole"),
        ("autoregressive", 2)]
    assert rows[3]["calls"] == 1 + 7 // 2 + 1 and rows[1]["calls"] == 1 + -(-rows[1]["rounds"] // 2)
    assert all(r["seconds"] > 0 and r["tokens"] == 8 for r in rows)


def test_probe_stream_calls_quick(tmp_path):
    out = tmp_path / "calls.json"
    run_script("bench/probe_stream_calls.py", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["chunk"]) for r in rows] == [
        ("autoregressive", 1), ("autoregressive", 2), ("speculative", 1), ("speculative", 2)]
    assert all(r["unfinished"] and r["temp_mb"] > 0 and r["faults_per_call"] >= 0
               and r["ms_per_step"] > 0 and r["idle_call_ms"] > 0 for r in rows)
