"""Whole Qwen3-8B decode steps (matmul_impl "xla" and "fused", `bench_fused_gemv.py
--decode-only`) under several XLA_FLAGS sets, one process each, in one run: which compiler
options shorten the step.

  python3 bench/bench_xla_flags.py --out $OUT/xla_flags.json          # H200, ~5 min
  python3 bench/bench_xla_flags.py --sets default pdl --quick --out /tmp/x.json   # CPU check

Each set's process writes its own JSON; the table (ms per token per set and impl, and the
ratio to the default set's "xla" step) is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import command_line, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
FLAG_SETS = {
    "default": "",
    "pdl": "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true",
    "triton_gemm_any": "--xla_gpu_triton_gemm_any=true",
    "cublaslt": "--xla_gpu_enable_cublaslt=true",
    "all_triton": "--xla_gpu_experimental_all_fusions_with_triton=true",
}


def run_set(name, flags, args):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        cmd = [sys.executable, str(HERE / "bench_fused_gemv.py"), "--decode-only",
               "--decode-models", *args.models, "--out", str(out)] + (["--quick"] if args.quick else [])
        env = {**os.environ, "XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                                  flags]))}
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout_s)
        row = {"set": name, "flags": flags, "wall_s": time.perf_counter() - t,
               "rc": proc.returncode}
        if proc.returncode or not out.is_file():
            row["error"] = (proc.stderr or proc.stdout)[-600:]
        else:
            result = json.loads(out.read_text())
            row.update(decode=result["decode"], device=result["device"])
    print(json.dumps(row), flush=True)
    return row


def report(rows):
    base = {r["model"]: r["ms_per_token"] for row in rows if row["set"] == "default"
            for r in row.get("decode", ()) if r.get("matmul_impl") == "xla" and
            "ms_per_token" in r}
    lines = ["| flags | model | matmul_impl | ms/token | vs default xla |", "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['set']} | error (rc {row['rc']}): "
                         f"{row['error'][-120:]!r} | | | |")
            continue
        for r in row["decode"]:
            if "ms_per_token" not in r:
                lines.append(f"| {row['set']} | {r['model']} | {r['matmul_impl']} | error | |")
                continue
            ratio = base.get(r["model"], float("nan")) / r["ms_per_token"]
            lines.append(f"| {row['set']} | {r['model']} | {r['matmul_impl']} | "
                         f"{r['ms_per_token']:.3f} | {ratio:.3f}x |")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sets", nargs="+", default=list(FLAG_SETS), choices=list(FLAG_SETS))
    parser.add_argument("--models", nargs="+", default=["qwen3-8b"])
    parser.add_argument("--quick", action="store_true", help="tiny models (CPU check)")
    parser.add_argument("--timeout-s", type=float, default=240, help="per flag set")
    args = parser.parse_args()
    rows = []
    for name in args.sets:
        try:
            rows.append(run_set(name, FLAG_SETS[name], args))
        except subprocess.TimeoutExpired:
            rows.append({"set": name, "flags": FLAG_SETS[name], "rc": None,
                         "error": f"timed out after {args.timeout_s} s"})
    result = {"rows": rows, "date": time.strftime("%Y-%m-%d"), "command": command_line()}
    if args.out:
        write_json(args.out, result)
    report(rows)


if __name__ == "__main__":
    main()
