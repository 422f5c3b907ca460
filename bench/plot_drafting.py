"""Plot bench/bench_drafting.py results: per-depth vs path-conditioned vs adaptive drafting.

  python -m bench.plot_drafting \
      bench/results/drafting/drafting_h200_batch16_shipped_2026-11-30.json \
      --labels "H200 batch 16" --out drafting.png

Left: tau against the time one decoding-loop iteration takes (every sequence of the batch runs
one round), so modes compare at equal time per round: at the same x, higher is better. Right:
speedup over autoregressive decoding against the budget limit. Colour = mode, line style =
result file; values are means over the benchmarks a file holds. Also prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib
matplotlib.use("Agg")  # headless: bench machines have no display
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from bench.common.results_io import write_atomic

MODES = {"per_depth": "tab:blue", "path": "tab:orange", "adaptive": "tab:green",
         "adaptive_path": "tab:red"}
STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]


def round_ms(row: dict, batch: int) -> float:
    """Milliseconds per loop iteration: tokens = iterations * batch * tau, so an iteration
    takes seconds * batch * tau / tokens = batch * tau / tok/s (sequences that finish early
    make this a slight overestimate, the same for every mode of one batch)."""
    return 1e3 * batch * row["tau"] / row["tokens_per_s"]


def batch_of(row: dict, result: dict) -> int:
    """The row's batch size; files written before rows carried it decoded --per-benchmark
    prompts of each benchmark as one batch."""
    if "batch" in row:
        return int(row["batch"])
    words = result.get("command", "").split()
    n = int(words[words.index("--per-benchmark") + 1]) if "--per-benchmark" in words else 1
    if n < 1:  # --per-benchmark 0: every prompt, a count the file does not keep
        raise ValueError("plot_drafting: the rows carry no batch size and --per-benchmark "
                         "was 0; rerun bench_drafting.py, whose rows now record it")
    return n


def summarize(result: dict) -> dict[tuple[str, int], dict]:
    """(mode, budget) -> means over benchmarks of tau, round ms, speedup, mean nodes; and how
    many benchmarks were pooled."""
    cells = defaultdict(list)
    for r in result["rows"]:
        cells[r["mode"], int(r["budget"])].append(r)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {key: {"tau": mean([r["tau"] for r in rows]),
                  "round_ms": mean([round_ms(r, batch_of(r, result)) for r in rows]),
                  "speedup": mean([r["speedup"] for r in rows]),
                  "nodes": mean([r["mean_nodes"] for r in rows]),
                  "n_bench": len(rows),
                  "identical": all(r["identical"] for r in rows)}
            for key, rows in cells.items()}


def table(summary: dict, label: str) -> str:
    lines = [f"**{label}**", "", "| budget | mode | tau | mean nodes | ms per round | speedup | "
             "benchmarks | = AR |", "|---|---|---|---|---|---|---|---|"]
    for (mode, budget), v in sorted(summary.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"| {budget} | {mode} | {v['tau']:.2f} | {v['nodes']:.1f} | "
                     f"{v['round_ms']:.2f} | {v['speedup']:.2f}x | {v['n_bench']} | "
                     f"{'yes' if v['identical'] else 'NO'} |")
    return "\n".join(lines)


def plot(results: list[dict], labels: list[str], out: Path) -> None:
    fig, (ax_tau, ax_sp) = plt.subplots(1, 2, figsize=(16, 5.2))
    budgets: set[int] = set()
    file_handles, seen_modes, any_partial = [], set(), False
    for i, (res, label) in enumerate(zip(results, labels)):
        ls, mk = STYLES[i % len(STYLES)]
        summary = summarize(res)
        full = max(v["n_bench"] for v in summary.values())
        for mode, color in MODES.items():
            pts = sorted((b, v) for (m, b), v in summary.items() if m == mode)
            if not pts:
                continue
            seen_modes.add(mode)
            budgets.update(b for b, _ in pts)
            for ax, x in ((ax_tau, lambda b, v: v["round_ms"]), (ax_sp, lambda b, v: b)):
                y = "tau" if ax is ax_tau else "speedup"
                ax.plot([x(b, v) for b, v in pts], [v[y] for _, v in pts], ls=ls, marker=mk,
                        color=color, ms=6, lw=1.6)
                part = [(x(b, v), v[y]) for b, v in pts if v["n_bench"] < full]
                any_partial |= bool(part)
                if part:  # open marker: fewer benchmarks pooled than the file's other points
                    ax.plot(*zip(*part), ls="none", marker=mk, ms=6, mfc="white", mec=color)
        file_handles.append(Line2D([], [], color="0.3", ls=ls, marker=mk,
                                   label=f"{label} ({res.get('device', '?')}, "
                                         f"{res.get('date', '?')})"))
    handles = [Line2D([], [], color=c, lw=3, label=m) for m, c in MODES.items()
               if m in seen_modes]
    handles += [Line2D([], [], color="0.3", ls="none", marker="o", mfc="white",
                       label="open marker: fewer benchmarks than the file's other points")
                ] * any_partial
    ax_tau.set_xscale("log")  # CPU and GPU rounds differ by ~50x
    ax_tau.set(xlabel="ms per decoding-loop iteration (one round for every sequence; log)",
               ylabel="tau: tokens committed per round",
               title="tau at equal time per round (higher at the same x is better)")
    ax_sp.set_xscale("log", base=2)
    ticks = sorted(budgets)
    ax_sp.set_xticks(ticks, [str(b) for b in ticks])
    ax_sp.minorticks_off()
    ax_sp.axhline(1.0, color="k", lw=0.8, ls=":")
    ax_sp.set(xlabel="tree budget (adaptive: the largest bucket allowed)",
              ylabel="speedup: AR seconds / speculative seconds",
              title="Wall-clock speedup over autoregressive decoding (1 = AR)")
    for ax in (ax_tau, ax_sp):
        ax.grid(True, alpha=0.3)
    ax_sp.legend(handles=handles + file_handles, fontsize=8, loc="upper left",
                 bbox_to_anchor=(1.02, 1.0))  # outside: the points fill the panel
    fig.suptitle(f"Drafting variants on {results[0].get('model', '?')}: means over benchmarks",
                 fontsize=13)
    fig.tight_layout()
    write_atomic(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="bench_drafting.py .json files")
    ap.add_argument("--labels", nargs="+", help="one per file (default: device and date)")
    ap.add_argument("--out", type=Path, default=Path("docs/img/drafting_variants.png"))
    args = ap.parse_args(argv)
    for path in args.results:
        if not path.is_file():
            raise SystemExit(f"plot_drafting: no result file at {path}")
    results = [json.loads(p.read_text()) for p in args.results]
    labels = args.labels or [f"{r.get('device', '?')} {r.get('date', '')}" for r in results]
    if len(labels) != len(results):
        raise SystemExit(f"plot_drafting: {len(results)} files but {len(labels)} labels")
    for res, label in zip(results, labels):
        print(table(summarize(res), label), end="\n\n")
    plot(results, labels, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
