"""Whole batch-1 decode steps with and without L2 prefetch of the next weights
(`ModelConfig.l2_prefetch_mb`, `pallas_kernels/l2_prefetch.py`), same process, same weights.

  python3 bench/bench_l2_prefetch.py --out $OUT/l2_prefetch.json          # H200, ~4 min
  python3 bench/bench_l2_prefetch.py --quick --out /tmp/l2.json            # CPU check

A setting is four sizes in MB, "qkv,o,mlp,down": how much of each matmul group is asked
into L2 before the small kernels that precede it. First a check: a few-layer cut of the model
decodes greedily the same tokens with each setting as without. Then the steps, the no-prefetch
baseline first and last (drift shows as their difference); the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import command_line, write_json  # noqa: E402

PEAK_TBPS = 4.25  # measured weight streaming on the H200 (docs/gpu.md)
SETTINGS = ["0,32,0,0", "8,32,16,4", "16,32,24,8", "24,32,32,16", "40,32,40,24"]


def parse(setting: str) -> tuple[float, ...]:
    sizes = tuple(float(s) for s in setting.split(","))
    if len(sizes) != 4:
        raise argparse.ArgumentTypeError(f"{setting!r}: needs four MB sizes qkv,o,mlp,down")
    return sizes


def check_tokens(cfg, settings, layers, steps=8):
    """Greedy tokens of a `layers`-layer cut with each setting equal those without."""
    import jax
    import jax.numpy as jnp

    from bench_decode import random_params
    from jetspec_jax import params as P
    from jetspec_jax.decode import ar_generate
    from jetspec_jax.sampling import Sampler

    cut = cfg.replace(num_layers=min(layers, cfg.num_layers))
    params = random_params(P.target_specs(cut))
    prompt = jax.random.randint(jax.random.key(3), (1, 16), 0, cut.vocab_size, jnp.int32)
    kw = dict(max_new=steps, sampler=Sampler(), stop_ids=(), num_slots=64,
              cache_dtype=jnp.bfloat16, attn_impl="auto")
    lens = jnp.array([16], jnp.int32)
    want = ar_generate(params, prompt, lens, jax.random.key(0), cfg=cut, **kw).tokens
    return {",".join(f"{s:g}" for s in mb): bool(jnp.array_equal(
        ar_generate(params, prompt, lens, jax.random.key(0),
                    cfg=cut.replace(l2_prefetch_mb=mb), **kw).tokens, want))
            for mb in settings}


def time_steps(cfg, settings, context):
    import jax

    from bench_decode import random_params, time_model, weight_bytes_per_token
    from jetspec_jax import params as P

    params = random_params(P.target_specs(cfg))
    rows = []
    for mb in [()] + list(settings) + [()]:
        row = time_model(cfg.replace(l2_prefetch_mb=mb), params, context, "auto",
                         PEAK_TBPS * 1e12)
        row.update(prefetch_mb=list(mb), weight_TBps=weight_bytes_per_token(cfg)
                   / (row["ms_per_token"] * 1e-3) / 1e12)
        rows.append(row)
        print(json.dumps(row), flush=True)
    del params
    jax.clear_caches()
    return rows


def report(rows, checks):
    base = [r["ms_per_token"] for r in rows if not r["prefetch_mb"]]
    ref = sum(base) / len(base)
    lines = [f"no-prefetch baseline: {' and '.join(f'{b:.3f}' for b in base)} ms (first, last)",
             "", "| prefetch MB qkv,o,mlp,down | tokens as without | ms/token | vs baseline "
             "| weights TB/s | % of 4.25 |", "|---|---|---|---|---|---|"]
    for r in rows:
        key = ",".join(f"{s:g}" for s in r["prefetch_mb"]) or "none"
        lines.append(f"| {key} | {checks.get(key, '-')} | {r['ms_per_token']:.3f} | "
                     f"{ref / r['ms_per_token']:.3f}x | {r['weight_TBps']:.2f} | "
                     f"{100 * r['weight_TBps'] / PEAK_TBPS:.1f} |")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--settings", nargs="+", type=parse, default=None)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--check-layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny-dense, small context (CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax

    from jetspec_jax import config

    settings = args.settings or [parse(s) for s in SETTINGS]
    cfg = config.preset("tiny-dense" if args.quick else args.model)
    if args.quick:
        settings, args.context = [(0.001, 0.001, 0.001, 0.001)], 32
    checks = check_tokens(cfg, settings, args.check_layers)
    print(json.dumps({"tokens_as_without": checks}), flush=True)
    rows = time_steps(cfg, settings, args.context)
    result = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
              "command": command_line(), "model": cfg.name, "context": args.context,
              "tokens_as_without": checks, "steps": rows}
    if args.out:
        write_json(args.out, result)
    report(rows, checks)


if __name__ == "__main__":
    main()
