"""Plot bench/serve_load.py results: per-token latency, request latency and tokens/s against
concurrency, one line per (result file, mode).

  python -m bench.plot_serving \
      bench/results/serving/smollm2_h200_bf16_capacity_chunk4_2026-12-02.json \
      --labels "H200, bfloat16, C requests in flight" --out docs/img/serving_h200.png
"""

from __future__ import annotations

import json

from bench.common.plots import files_labels_out, plt, save_png

PANELS = (("tpot_s_p50", 1e3, "per-token latency p50 (ms)"),
          ("latency_s_p50", 1.0, "request latency p50 (s)"),
          ("tokens_per_s", 1.0, "tokens/s"))
MODES = {"speculative": "tab:blue", "autoregressive": "tab:gray"}
STYLES = ("o-", "s--", "^:", "D-.")


def main() -> None:
    args = files_labels_out(__doc__, "results")
    labels = args.labels
    fig, axes = plt.subplots(1, len(PANELS), figsize=(14, 4))
    for path, label, style in zip(args.results, labels, STYLES):
        with open(path) as f:
            rows = json.load(f)["rows"]
        for mode, color in MODES.items():
            mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["concurrency"])
            if not mine:
                continue
            for ax, (key, scale, _) in zip(axes, PANELS):
                ax.plot([r["concurrency"] for r in mine], [r[key] * scale for r in mine], style,
                        color=color, label=f"{mode}, {label}")
            for r in mine:
                print(f"{label:>12} {mode:>15} C={r['concurrency']:<3} "
                      f"TPOT {r['tpot_s_p50'] * 1e3:.2f} ms  tokens/s {r['tokens_per_s']:.0f}")
    for ax, (_, _, name) in zip(axes, PANELS):
        ax.set(xscale="log", xlabel="concurrency (requests in flight at most)", ylabel=name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_png(fig, args.out)


if __name__ == "__main__":
    main()
