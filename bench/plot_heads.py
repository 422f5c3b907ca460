"""Plot bench/compare_heads.py results: tau and speedup over autoregressive decoding vs tree budget.

  python -m bench.plot_heads bench/results/heads/heads_h200_bf16_scratch_700steps_2026-12-03.json \
      bench/results/heads/heads_cpu_f32_b1_scratch_700steps_2026-12-03.json \
      --labels "H200, batch 555" "CPU, batch 1" --out heads.png

Left: tau (tokens committed per round) pooled over benchmarks; right: wall-clock speedup over AR.
Colour = head, line style/marker = result file; open markers = fewer benchmarks pooled than the
file's other points (e.g. a run cut short). Also prints a markdown table of tau / speedup per file.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections import defaultdict
from pathlib import Path

import matplotlib
matplotlib.use("Agg")  # headless: bench machines have no display
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from bench.common.results_io import write_atomic

HEADS = {"jetspec": "tab:blue", "dflash": "tab:orange", "eagle": "tab:green"}
STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]


def pooled_tau(hists: list[list[int]]) -> float:
    """Tau over all rounds of several cells: pooled, so each round counts once (not each cell)."""
    rounds = sum(sum(h) for h in hists)
    return sum(k * n for h in hists for k, n in enumerate(h)) / rounds if rounds else float("nan")


def summarize(result: dict) -> dict[tuple[str, int], dict]:
    """(head, budget) -> {"tau", "n_bench", "speedup"}; speedup None: no AR timings (sampling)."""
    hists, cell_times, run_times = defaultdict(list), defaultdict(list), defaultdict(list)
    for c in result["cells"].values():
        hists[c["head"], int(c["budget"])].append(c["tau_hist"])
        cell_times[c["head"], int(c["budget"])].append((c.get("ar_seconds"), c["seconds"]))
    for r in result.get("runs", {}).values():
        run_times[(r["head"], int(r["budget"]))].append((r.get("ar_seconds"), r["seconds"]))
    out = {}
    for key, hs in hists.items():
        # A run is one timed batch; budgets timed before "runs" existed only have cells.
        times = run_times.get(key) or cell_times[key]
        ok = times and all(ar is not None for ar, _ in times)
        speed = sum(ar for ar, _ in times) / sum(s for _, s in times) if ok else None
        out[key] = {"tau": pooled_tau(hs), "n_bench": len(hs), "speedup": speed}
    return out


def default_label(result: dict) -> str:
    temp = float(result.get("args", {}).get("temperature", 0.0))
    where = result.get("device") or result.get("backend", "?")
    where = where.upper() if where in ("cpu", "gpu", "tpu") else where
    return f"{where} {'greedy' if temp == 0 else f'T={temp:g}'}"


def table(summary: dict[tuple[str, int], dict]) -> str:
    """Markdown table head x budget of 'tau / speedup'; '(n bench)' marks partially pooled cells."""
    budgets = sorted({b for _, b in summary})
    full = max(v["n_bench"] for v in summary.values())
    lines = ["| head | " + " | ".join(f"budget {b}" for b in budgets) + " |",
             "|---" * (len(budgets) + 1) + "|"]
    for head in HEADS:
        row = []
        for b in budgets:
            v = summary.get((head, b))
            sp = v and (f"{v['speedup']:.2f}x" if v["speedup"] is not None else "n/a")
            part = f" ({v['n_bench']} bench)" if v and v["n_bench"] < full else ""
            row.append(f"{v['tau']:.2f} / {sp}{part}" if v else "-")
        lines.append(f"| {head} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: list[dict], labels: list[str], out: Path) -> None:
    fig, (ax_tau, ax_sp) = plt.subplots(1, 2, figsize=(13, 5.2))
    budgets: set[int] = set()
    file_handles, any_partial = [], False
    for i, (res, label) in enumerate(zip(results, labels)):
        ls, mk = STYLES[i % len(STYLES)]
        summary = summarize(res)
        full = max(v["n_bench"] for v in summary.values())
        has_speed = any(v["speedup"] is not None for v in summary.values())
        for head, color in HEADS.items():
            pts = sorted((b, v) for (h, b), v in summary.items() if h == head)
            budgets.update(b for b, _ in pts)
            partial = {b for b, v in pts if v["n_bench"] < full}
            any_partial |= bool(partial)
            sp = [(b, v["speedup"]) for b, v in pts if v["speedup"] is not None]
            for ax, xy in ((ax_tau, [(b, v["tau"]) for b, v in pts]), (ax_sp, sp)):
                ax.plot(*zip(*xy), ls=ls, marker=mk, color=color, ms=6, lw=1.6)
                part = [(b, y) for b, y in xy if b in partial]
                if part:  # open marker: fewer benchmarks pooled than the file's other points
                    ax.plot(*zip(*part), ls="none", marker=mk, ms=6, mfc="white", mec=color)
        dev = res.get("device")  # GPU files name the chip; for the CPU the host line says more
        where = dev if dev and dev != "cpu" else res.get("machine", res.get("backend", "?"))
        note = "" if has_speed else "; sampling, no AR timing: not in right panel"
        file_handles.append(Line2D([], [], color="0.3", ls=ls, marker=mk,
                                   label=f"{label} ({where}, {res.get('date', '?')}{note})"))
    # Heads (and the open-marker key) fill the legend's first column, files the second.
    handles = [Line2D([], [], color=c, lw=3, label=h) for h, c in HEADS.items()]
    handles += [Line2D([], [], color="0.3", ls="none", marker="o", mfc="white",
                       label="open marker: fewer benchmarks pooled than the file's other "
                       "points")] * any_partial
    ticks = sorted(budgets)
    for ax in (ax_tau, ax_sp):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(b) for b in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tree budget (draft tokens verified per round)")
        ax.grid(True, alpha=0.3)
    ax_sp.axhline(1.0, color="k", lw=0.8, ls=":")
    ax_tau.set(ylabel="tau: tokens committed per round",
               title="Mean accepted length tau, pooled over benchmarks")
    ax_sp.set(ylabel="speedup: AR seconds / speculative seconds",
              title="Wall-clock speedup over autoregressive decoding (1 = AR)")
    model = results[0].get("model", "?")
    # The line styles' legend names each run; the title only has to fit the figure.
    fig.suptitle(textwrap.fill(f"Draft heads on {model}: " + ", ".join(labels), 110), fontsize=13)
    handles += file_handles
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.01 + 0.045 * ((len(handles) + 1) // 2), 1, 1))
    try:
        write_atomic(out, lambda f: fig.savefig(f, dpi=130, format="png"))
    finally:
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="JSON written by bench/compare_heads.py")
    p.add_argument("--labels", nargs="+", help="one per file (default: device + temperature)")
    p.add_argument("--out", type=Path, default=Path("docs/img/heads_tau_speedup.png"))
    a = p.parse_args(argv)
    missing = [str(f) for f in a.files if not f.is_file()]
    if missing:
        p.error(f"no such result file: {', '.join(missing)}")
    results = [json.loads(f.read_text()) for f in a.files]
    labels = a.labels or [default_label(r) for r in results]
    if len(labels) != len(results):
        p.error(f"{len(labels)} labels for {len(results)} files")
    for f, r, label in zip(a.files, results, labels):
        print(f"\n### {label} ({f}): tau / speedup\n\n{table(summarize(r))}")
    plot(results, labels, a.out)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
