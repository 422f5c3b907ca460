"""Plot training logs (`metrics.jsonl` of `jetspec train-draft`): held-out tau and per-depth KL
against steps, the training loss beside them.

  python -m bench.plot_training runs/head/metrics.jsonl --labels "my head" --out curves.png

The shipped head's run (its log, every stretch of one schedule):

  python -m bench.plot_training checkpoints/smollm2-135m-jetspec-run/metrics.jsonl \
      --labels "the long run" --out curves.png

--step-offsets: added to each log's steps (a run that started its own step count from a
head's weights). Left: held-out tau at the tree budget the trainer evaluates with; middle: held-out KL per draft
depth at each evaluation (darker = later step); right: training loss. Prints the eval rows.
"""

from __future__ import annotations

import json

from bench.common.plots import files_labels_out, plt, save_png


def read_log(path: str) -> list[dict]:
    """The rows of a metrics.jsonl, or the log of a training record (.json, under run.log)."""
    with open(path) as f:
        if path.endswith(".json"):
            return json.load(f)["run"]["log"]
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    args = files_labels_out(__doc__, "logs", extra=lambda ap: ap.add_argument(
        "--step-offsets", type=int, nargs="+", help="one per log (default: 0 each)"))
    labels = args.labels
    offsets = args.step_offsets or [0] * len(args.logs)
    if len(offsets) != len(args.logs):
        raise SystemExit("error: give one --step-offsets entry per log")
    fig, (tau_ax, kl_ax, loss_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (path, label, offset) in enumerate(zip(args.logs, labels, offsets)):
        rows = [{**r, "step": r["step"] + offset} for r in read_log(path)]
        evals = [r for r in rows if "eval" in r]
        color = f"C{i}"
        trained = [r for r in rows if "loss" in r]  # an eval off the log interval has no loss
        loss_ax.plot([r["step"] for r in trained], [r["loss"] for r in trained], color=color,
                     lw=0.8, label=label)
        if not evals:
            continue
        tau_ax.plot([r["step"] for r in evals], [r["eval"]["tau"] for r in evals], "o-",
                    color=color, label=label)
        for j, r in enumerate(evals):
            kl = r["eval"]["kl"]
            kl_ax.plot(range(1, len(kl) + 1), kl, color=color, alpha=0.3 + 0.7 * (j + 1) / len(evals),
                       label=f"{label}, step {r['step']}")
            print(f"{label}: step {r['step']}: tau {r['eval']['tau']:.2f}, KL depth 1 {kl[0]:.2f}"
                  f", depth {len(kl)} {kl[-1]:.2f}")
    tau_ax.set(xlabel="step", ylabel="held-out tau (tokens per round)", title="acceptance")
    kl_ax.set(xlabel="draft depth", ylabel="held-out KL(target || head)", title="KL by depth")
    loss_ax.set(xlabel="step", ylabel="training loss", title="loss")
    for ax in (tau_ax, kl_ax, loss_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_png(fig, args.out)


if __name__ == "__main__":
    main()
