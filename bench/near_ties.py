"""How close are greedy decoding's near-ties? The top-2 logit gaps of the random float32 target
that `bench_sharded.py --num-layers 4 --dtype float32` checks (same weights, same synthetic
state), batch 16, 36 greedy steps on one device: a flip between two meshes needs a numerical
difference as large as the smallest gap.

  python bench/near_ties.py --out bench/results/near_ties_qwen3-8b_4layers_2026-11-29.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import command_line, write_json  # noqa: E402

import bench_sharded  # noqa: E402
from jetspec_jax.draft import head as draft_head
from jetspec_jax.model import config, params as P, sharding, target  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=36)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = config.preset(args.model).replace(num_layers=args.num_layers)
    dcfg = draft_head.draft_config_for(cfg, num_layers=5, block_size=bench_sharded.BLOCK,
                                       num_taps=min(5, cfg.num_layers - 1))
    bench = argparse.Namespace(rounds=[1, 5], context=1024, budgets=[16], batches=[args.batch],
                               ar_steps=[4, args.steps], attn_impl="reference",
                               dtype=jnp.dtype("float32"))
    mesh = sharding.make_mesh("1")
    make_state = bench_sharded.programs(cfg, dcfg, mesh, bench)[("state", args.batch)].compile()
    state = make_state(sharding.replicate(jax.random.key(1), mesh))
    tparams = bench_sharded.random_params(P.target_specs(cfg), mesh, bench.dtype)

    @jax.jit
    def step(tp, cache, last):
        pos = cache.lengths
        hidden, cache, _ = target.forward(tp, cfg, last[:, None], pos[:, None], cache, pos,
                                          attn_impl="reference")
        logits = target.lm_head(tp, cfg, hidden)[:, 0]
        return (jnp.argmax(logits, -1), cache.replace(lengths=pos + 1),
                jax.lax.top_k(logits, 2)[0])

    cache, last, tops = state.cache, state.anchor, []
    for _ in range(args.steps):
        last, cache, top2 = step(tparams, cache, last)
        tops.append(np.asarray(top2))
    tops = np.stack(tops, 1)  # [B, steps, 2]
    gap = tops[..., 0] - tops[..., 1]
    rel = gap / np.abs(tops[..., 0])
    result = {"backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"),
              "command": command_line(), "tokens": int(gap.size),
              "median_abs_top1": float(np.median(np.abs(tops[..., 0]))),
              "min_gap": float(gap.min()), "median_gap": float(np.median(gap)),
              "smallest_relative_gaps": np.sort(rel.ravel())[:5].tolist()}
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
