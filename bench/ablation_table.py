"""The table of an ablation (`scripts/ablate_head.sh`): one row per variant folder, with its
settings, the held-out tau and KL per depth of its last evaluation, and its step time.

  python -m bench.ablation_table runs/ablate/ablate --out ablation.json

A variant that has not reached its last step is listed as unfinished (no tau). Rows follow
held-out tau, best first. --out also keeps each variant's metric log rows, for plots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common.results_io import command_line, write_json

SETTINGS = ("head_layers", "block_size", "num_anchors", "gamma", "depth1_weight",
            "norm_from_target", "head_attention", "steps", "batch_size", "lr")


def read_variant(folder: Path) -> dict | None:
    """The summary of one variant's run, or None when the folder holds no run."""
    run = folder / "jetspec"
    log = run / "metrics.jsonl"
    if not log.is_file():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    meta_path = run / "head" / "metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    config = meta.get("train_config", {})
    evals = [r for r in rows if "eval" in r]
    last = evals[-1] if evals and meta.get("complete") else None
    times = [r["step_s"] for r in rows if "step_s" in r]
    return {"variant": folder.name, "complete": bool(meta.get("complete")),
            "steps_done": rows[-1]["step"] if rows else 0,
            "settings": {k: config.get(k) for k in SETTINGS},
            "tau": last["eval"]["tau"] if last else None,
            "kl": last["eval"]["kl"] if last else None,
            "step_s": sorted(times)[len(times) // 2] if times else None,
            "log": rows}


def table(variants: list[dict]) -> str:
    lines = ["| variant | tau @64 | KL depth 1 / 8 / 15 | step (s) |", "|---|---|---|---|"]
    ranked = sorted(variants, key=lambda v: -(v["tau"] if v["tau"] is not None else -1))
    for v in ranked:
        if v["tau"] is None:
            lines.append(f"| {v['variant']} | unfinished (step {v['steps_done']}) | - | - |")
            continue
        kl = v["kl"]
        picks = " / ".join(f"{kl[d - 1]:.3f}" for d in (1, 8, 15) if d <= len(kl))
        lines.append(f"| {v['variant']} | {v['tau']:.3f} | {picks} | {v['step_s']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="the ablate folder: one sub-folder per variant")
    ap.add_argument("--out", help="a JSON file for the table and the logs")
    args = ap.parse_args()
    root = Path(args.folder)
    if not root.is_dir():
        raise SystemExit(f"error: {root} is not a folder")
    variants = [v for d in sorted(root.iterdir()) if d.is_dir()
                if (v := read_variant(d)) is not None]
    if not variants:
        raise SystemExit(f"error: {root} holds no variant's metrics.jsonl")
    print(table(variants))
    if args.out:
        write_json(args.out, {"command": command_line(), "variants": variants})


if __name__ == "__main__":
    main()
