"""What restarting from a head's weights alone costs: a tiny run on the CPU trained straight
through, against the same run restarted at the middle step from its weights (float32 or
bfloat16 files) with a fresh AdamW re-warmed over a few steps (`train-draft --init-head`).

    python scripts/reinit_cost.py --out /tmp/reinit [--steps 400 --restart 200 --warmup 20]

Prints the windowed training loss of both runs after the restart and writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import tiny_target  # noqa: E402

from jetspec_jax.decode.sampling import Sampler  # noqa: E402
from jetspec_jax.io.heads import save_draft  # noqa: E402
from jetspec_jax.train import data as D  # noqa: E402
from jetspec_jax.train.trainer import TrainConfig, read_metrics, train  # noqa: E402


class Chars:
    """A 'chat template' of [BOS, chars...] for the tiny target."""

    eos_token_ids, pad_id = (), 0

    def apply_chat_template(self, messages):
        return [1] + [2 + ord(c) % 30 for c in messages[0]["content"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--restart", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = ap.parse_args()
    if not 0 < args.restart < args.steps:
        raise SystemExit(f"error: --restart must be in (0, {args.steps})")
    out = Path(args.out)
    tcfg, tp = tiny_target("dense", seed=2, vocab=32)
    prompts = [f"question {i}: " + "abcde"[i % 5] * (i % 7) for i in range(256)]
    D.make_dataset(tp, tcfg, Chars(), prompts, out / "data", shard_size=64, max_prompt_len=24,
                   max_new=24, batch_size=64, sampler=Sampler(temperature=1.0), seed=0)
    cfg = TrainConfig(data_dir=str(out / "data"), out_dir=str(out / "straight"), head_layers=2,
                      block_size=8, num_taps=2, steps=args.steps, batch_size=16, num_anchors=8,
                      lr=3e-3, warmup_steps=args.warmup, log_every=10, ckpt_every=args.restart,
                      keep_ckpts=10, tau_prompts=0)
    straight = train(cfg, tp, tcfg)
    from jetspec_jax.train.state import restore_state
    from jetspec_jax.train.trainer import make_optimizer

    like = {"params": straight.dparams,
            "opt_state": make_optimizer(cfg)[0].init(straight.dparams)}
    state, _ = restore_state(out / "straight" / "checkpoints" / f"step_{args.restart:08d}", like)
    save_draft(out / "weights", state["params"], straight.dcfg, max_bytes=15 * 2**20,
               dtype=jnp.dtype(args.dtype), overwrite=True)
    restarted = dataclasses.replace(cfg, out_dir=str(out / "restarted"),
                                    init_head=(str(out / "weights"),), start_step=args.restart)
    train(restarted, tp, tcfg)
    rows = {name: {r["step"]: r["loss"] for r in read_metrics(out / name / "metrics.jsonl")}
            for name in ("straight", "restarted")}
    steps = sorted(rows["restarted"])
    print("step  straight  restarted  ratio")
    for s in steps:
        a, b = rows["straight"][s], rows["restarted"][s]
        print(f"{s:5d}  {a:.4f}    {b:.4f}     {b / a:.3f}")
    ratio = np.array([rows["restarted"][s] / rows["straight"][s] for s in steps])
    summary = {"settings": vars(args), "rows": rows, "max_ratio": float(ratio.max()),
               "last_ratio": float(ratio[-1]), "backend": jax.default_backend()}
    (out / "reinit_cost.json").write_text(json.dumps(summary, indent=1))
    print(f"max ratio {ratio.max():.3f} (step {steps[int(ratio.argmax())]}), last {ratio[-1]:.3f}")


if __name__ == "__main__":
    main()
