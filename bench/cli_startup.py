"""How long `jetspec --help` and each subcommand's `--help` take: each run as a fresh process,
several times; the table gives the median and the slowest (seconds).

    python -m bench.cli_startup            # 5 runs each
    python -m bench.cli_startup --runs 9
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from bench.common.results_io import ROOT
COMMANDS = ([], ["convert"], ["generate"], ["bench"], ["train-data"], ["train-draft"],
            ["cache"])


def seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jetspec_jax.cli", *argv, "--help"], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    runs = p.parse_args().runs
    print(f"{'command':<28} {'median s':>9} {'max s':>7}")
    for argv in COMMANDS:
        times = [seconds(argv) for _ in range(runs)]
        name = " ".join(["jetspec", *argv, "--help"])
        print(f"{name:<28} {statistics.median(times):>9.3f} {max(times):>7.3f}")


if __name__ == "__main__":
    main()
