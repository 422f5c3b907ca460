"""The first and the second `jetspec generate --compare` (the README's main command) on this
machine, with a fresh cache directory: wall time of each run, and its loading (conversion on
the first run, the cached checkpoint after) and compile parts, as the CLI reports them.

    python -m bench.first_run                      # SmolLM2-135M-Instruct, the shipped head
    python -m bench.first_run --out bench/results/first_run/cpu.json -- --max-new-tokens 32

Arguments after `--` go to `jetspec generate`. The cache directory is a temporary one (the
user's cache is not touched) and is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.results_io import ROOT, command_line, write_json

FIGURES = {  # what the CLI prints -> the figure
    "target_load_s": r"note: target \S+ loaded in ([\d.]+) s",
    "draft_load_s": r"note: draft head loaded in ([\d.]+) s",
    "spec_compile_s": r"tok/s \(compile \+ warm-up ([\d.]+) s\)",
    "ar_compile_s": r"autoregressive: [\d.]+ tok/s \(compile \+ warm-up ([\d.]+) s\)",
}


def run_once(cache: Path, extra: list[str]) -> dict:
    env = {**os.environ, "JETSPEC_CACHE": str(cache)}
    env.pop("JETSPEC_NO_CACHE", None)
    env.pop("JETSPEC_NO_COMPILE_CACHE", None)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jetspec_jax.cli", "generate", "--compare",
                          *extra], capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"generate failed ({out.returncode}):\n{out.stderr[-2000:]}")
    text = out.stdout + out.stderr
    row = {"wall_s": round(wall, 2)}
    for name, pattern in FIGURES.items():
        m = re.search(pattern, text)
        row[name] = float(m.group(1)) if m else None
    row["converted"] = "note: converted " in out.stderr
    row["summary"] = out.stdout.strip().splitlines()[-4:]
    return row


def gpu_name() -> str | None:
    """The first NVIDIA GPU's name, without importing JAX (None on a CPU machine)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the figures as JSON")
    p.add_argument("--keep", action="store_true", help="keep the cache directory")
    args = p.parse_args(argv)
    cache = Path(tempfile.mkdtemp(prefix="jetspec-first-run-"))
    rows = [run_once(cache, extra) for _ in range(2)]
    print(f"{'run':>6} {'wall s':>8} {'load s':>8} {'compile s':>10}  (spec + AR)")
    for name, r in zip(("first", "second"), rows):
        comp = (r["spec_compile_s"] or 0) + (r["ar_compile_s"] or 0)
        print(f"{name:>6} {r['wall_s']:>8.1f} {r['target_load_s'] or 0:>8.1f} {comp:>10.1f}"
              + ("  converted" if r["converted"] else ""))
    if args.out:
        import platform

        write_json(args.out, dict(command=command_line(), machine=platform.machine(),
                                  cpus=os.cpu_count(), gpu=gpu_name(),
                                  date=time.strftime("%Y-%m-%d"), runs=rows))
        print(f"wrote {args.out}")
    if not args.keep:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
