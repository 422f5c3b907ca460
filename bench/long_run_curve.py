"""A long training run's curve (`scripts/long_run.sh`): per stretch, its data (sequences,
tokens, generation and teacher seconds) and training (steps, seconds, step time, tokens/s,
model-FLOP utilisation), and held-out tau and KL per depth against the GPU minutes spent so
far (data generation included), from the run's state folder.

  python -m bench.long_run_curve checkpoints/smollm2-135m-jetspec-run \
      --out bench/results/training/long_run_smollm2.json --plot docs/img/long_run.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.common.results_io import command_line, write_json


def stretches(rows: list[dict], starts: list[int]) -> list[list[dict]]:
    """The log's rows, one list per stretch. A stretch begins after the step it started from
    (`starts`: long_run.sh seeds each stretch's data with 1000 + that step) or where the
    training clock restarts (a log that was not resumed)."""
    out: list[list[dict]] = []
    for r in rows:
        new_stretch = (not out or r.get("time", 0.0) < out[-1][-1].get("time", 0.0)
                       or any(out[-1][-1]["step"] <= s < r["step"] for s in starts))
        if new_stretch:
            out.append([])
        out[-1].append(r)
    return out


def summary(state: Path) -> dict:
    rows = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    data = [json.loads(p.read_text()) for p in sorted(
        state.glob("data-seed*.json"), key=lambda p: int(p.stem.removeprefix("data-seed")))]
    starts = [d["settings"]["seed"] - 1000 for d in data]
    table, curve, minutes, clock = [], [], 0.0, 0.0
    for i, part in enumerate(stretches(rows, starts)):
        d = data[i] if i < len(data) else None
        g = d["generation"] if d else {}
        data_s = sum(g.get(k, 0.0) for k in ("seconds", "compile_seconds", "teacher_seconds",
                                              "teacher_compile_seconds"))
        if part[0].get("time", 0.0) < clock:  # the clock restarted with this stretch
            clock = 0.0
        timed = [r for r in part if "step_s" in r][3:]  # past compilation and warm-up

        def median(k):
            return round(statistics.median(r[k] for r in timed), 4) if timed else None

        table.append(dict(
            logged_steps=[part[0]["step"], part[-1]["step"]],
            data_seed=d and d["settings"]["seed"], sequences=d and d["num_seqs"],
            tokens=d and d["num_tokens"],
            generated_tokens=g.get("new_tokens"), generation_s=g.get("seconds"),
            teacher_s=g.get("teacher_seconds"), train_s=round(part[-1]["time"] - clock, 1),
            step_s=median("step_s"), tok_s=median("tok_s"), mfu=median("mfu")))
        for r in part:
            if "eval" in r:
                curve.append(dict(step=r["step"], gpu_minutes=round(
                    minutes + (data_s + r["time"] - clock) / 60, 2), tau=r["eval"].get("tau"),
                    kl=r["eval"]["kl"], acc=r["eval"]["acc"]))
        minutes += (data_s + part[-1]["time"] - clock) / 60
        clock = part[-1]["time"]
    return dict(stretches=table, heldout=curve, gpu_minutes=round(minutes, 2))


def plot(result: dict, path: str) -> None:
    from bench.common.plots import plt, save_png

    fig, (tau_ax, kl_ax) = plt.subplots(1, 2, figsize=(10, 4))
    pts = result["heldout"]
    tau_ax.plot([p["gpu_minutes"] for p in pts], [p["tau"] for p in pts], "o-")
    tau_ax.set(xlabel="GPU minutes (data and training)", ylabel="held-out tau",
               title="acceptance, whole answers")
    for j, p in enumerate(pts):
        kl_ax.plot(range(1, len(p["kl"]) + 1), p["kl"], color="C0",
                   alpha=0.3 + 0.7 * (j + 1) / len(pts), label=f"step {p['step']}")
    kl_ax.set(xlabel="draft depth", ylabel="held-out KL(target || head)", title="KL by depth")
    for ax in (tau_ax, kl_ax):
        ax.grid(alpha=0.3)
    kl_ax.legend(fontsize=7)
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("state", type=Path, help="the run's state folder")
    ap.add_argument("--out", help="result file (JSON)")
    ap.add_argument("--plot", help="PNG of held-out tau against GPU minutes, KL by depth")
    ap.add_argument("--note", default="", help="kept in the result")
    args = ap.parse_args()
    result = dict(command=command_line(), note=args.note, **summary(args.state))
    for s in result["stretches"]:
        print(s)
    for p in result["heldout"]:
        print(f"step {p['step']}: {p['gpu_minutes']} GPU minutes, held-out tau {p['tau']:.2f}, "
              f"KL depth 1 {p['kl'][0]:.3f}")
    if args.out:
        write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
