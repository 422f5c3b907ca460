"""Projected speedup of speculative decoding from measured round costs and measured (or the
paper's) tau: speedup = tau * t(AR step) / t(round) = tau / (round / AR).

The round costs come from bench/bench_speculative.py (measured on the GPU, e.g. Qwen3-8B with
random weights); tau comes from bench/compare_heads.py (measured on a real target: SmolLM2
with our heads) or from the paper (Qwen3-8B at budget 256 only). Only round/AR is measured
for the timed model; every speedup in the table is a projection, and the table says so.

  python -m bench.project_speedup \
      --rounds bench/results/speculative/speculative_round_layout_fused_h200_2026-11-30.json \
      --heads bench/results/heads/heads_h200_bf16_scratch_700steps_2026-12-03.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from bench.plot_heads import pooled_tau

PAPER_TAU = {"MATH-500": 10.76, "MT-Bench": 5.94}  # Qwen3-8B, budget 256 (the paper's table)
PAPER_BUDGET = 256
# Heads whose round costs what bench_speculative times (one block forward of the draft); an
# EAGLE-style head drafts depth by depth, so its round would cost more than the measured one.
BLOCK_HEADS = ("jetspec", "dflash")


def measured_tau(heads_results: list[dict]) -> dict[tuple[str, int], tuple[float, str]]:
    """(head, budget) -> (tau pooled over every benchmark's rounds, where it was measured);
    the first file holding a (head, budget) wins."""
    out = {}
    for res in heads_results:
        hists = defaultdict(list)
        for c in res["cells"].values():
            hists[c["head"], int(c["budget"])].append(c["tau_hist"])
        where = f"{res.get('device') or res.get('backend', '?')}, {res.get('date', '?')}"
        for key, hs in hists.items():
            if key[0] in BLOCK_HEADS:
                out.setdefault(key, (pooled_tau(hs), where))
    return out


def table(rounds: list[dict], taus: dict, heads: list[str]) -> str:
    cols = ["model", "batch", "context", "budget", "round / AR (measured)",
            "tau for 1x / 3x"]
    cols += [f"{h}: tau -> x" for h in heads] + [f"paper {k} (tau {v})" for k, v in
                                                 PAPER_TAU.items()]
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for r in rounds:
        ratio = r["round_over_ar"]
        cells = [r["model"], r["batch"], r["context"], r["budget"], f"{ratio:.2f}",
                 f"{ratio:.2f} / {3 * ratio:.2f}"]
        for h in heads:
            tau = taus.get((h, int(r["budget"])))
            cells.append(f"{tau[0]:.2f} -> {tau[0] / ratio:.2f}x" if tau else "-")
        for tau in PAPER_TAU.values():
            cells.append(f"{tau / ratio:.2f}x" if r["budget"] == PAPER_BUDGET else "-")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", nargs="+", type=Path, required=True,
                    help="bench_speculative.py .json files")
    ap.add_argument("--heads", nargs="*", type=Path, default=[],
                    help="compare_heads.py .json files (tau per head and budget)")
    ap.add_argument("--batches", type=int, nargs="*", help="only the rows of these batch sizes")
    args = ap.parse_args(argv)
    for path in [*args.rounds, *args.heads]:
        if not path.is_file():
            raise SystemExit(f"project_speedup: no result file at {path}")
    rounds = sorted((r for p in args.rounds for r in json.loads(p.read_text())["rows"]
                     if not args.batches or r["batch"] in args.batches),
                    key=lambda r: (r["model"], r["context"], r["batch"], r["budget"]))
    taus = measured_tau([json.loads(p.read_text()) for p in args.heads])
    heads = sorted({h for h, _ in taus})
    print(table(rounds, taus, heads))
    budgets = defaultdict(set)
    for (_, b), (_, where) in taus.items():
        budgets[where].add(b)
    print("\nround / AR is measured; every speedup is projected (tau x AR step / round). "
          "tau measured on SmolLM2-135M-Instruct with our heads: "
          + "; ".join(f"{where} at budgets {sorted(bs)}" for where, bs in budgets.items()))


if __name__ == "__main__":
    main()
