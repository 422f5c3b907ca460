"""Drafting variants at equal budgets: the per-depth tree (the paper's drafter) and the adaptive
budget (`jetspec_jax/decode/adaptive.py`, buckets up to the budget), each against autoregressive
decoding of the same batch. Greedy; outputs are compared token for token with autoregressive
decoding.

Prompts come from the benchmark sets of `bench.common.prompts`. Per
benchmark and budget it reports tau (tokens committed per round), tok/s, the speedup over
autoregressive decoding and, for the adaptive modes, the mean tree size actually verified.
The adaptive cost table is measured on this device at start-up (`costs.measure_costs`)
and stored with the results.

  python -m bench.bench_drafting --draft runs/head/head --per-benchmark 16 --budgets 64 256
  # smoke test with a random head (numbers meaningless; do not commit them):
  python -m bench.bench_drafting --draft random --benchmarks mtbench --per-benchmark 2 \\
      --max-new-tokens 8 --budgets 32 --out /tmp/drafting_smoke

Rows are written as they come; --resume keeps an existing --out file's rows and cost tables
and runs only the missing ones (each row carries the AR speed of its own run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


from bench.common.results_io import command_line, resume, write_json, write_text

import jax
import jax.numpy as jnp
import numpy as np

from bench.common.prompts import BENCHMARKS
from jetspec_jax import api, costs as round_costs
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import TreeSpec, spec_generate, working_slots
from jetspec_jax.draft import head as draft_head
from jetspec_jax.model import params as P
from jetspec_jax.options import GPU_BUCKETS

MODES = {"per_depth": False, "adaptive": True}  # name -> adaptive
COSTS = "per_depth"  # the key of the round-cost table in a result's "costs" (the drafter's)


def random_draft(target: api.Target, seed: int) -> api.Draft:
    """A reference-shaped head (5 layers, block 16, 5 taps) with random weights."""
    dcfg = draft_head.draft_config_for(target.cfg)
    params = P.init_params(draft_head.draft_specs(dcfg), jax.random.key(seed), target.dtype)
    return api.Draft(dcfg, params, "random")


def run_timed(fn, args, static):
    """-> (outputs, compile + warm-up seconds, seconds of one more run)."""
    start = time.perf_counter()
    compiled = fn.lower(*args, **static).compile()
    jax.block_until_ready(compiled(*args))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    return out, compile_s, time.perf_counter() - start


def generated(out) -> list[list[int]]:
    tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
    return [tokens[b, :n].tolist() for b, n in enumerate(counts)]


def tree_spec(mode: str, budget: int, width: int, costs: dict) -> TreeSpec:
    if not MODES[mode]:
        return TreeSpec(budget, width)
    table = {b: t for b, t in costs[COSTS].items() if b <= budget}
    return round_costs.auto_tree_spec(table or {budget: 1.0}, width=width)


def bench_one(target, draft, ids, args, costs, kernels, done=frozenset()):
    """Yields one row per (budget, mode) of one benchmark, skipping those in `done`."""
    todo = [(b, m) for b in args.budgets for m in args.modes if (b, m) not in done]
    if not todo:
        return
    loop = functools.partial(Loop, max_new=args.max_new_tokens, kernels=kernels,
                             cache_dtype=jnp.dtype(target.dtype))
    key = jax.random.key(0)
    batch = api.make_batch(target, ids, args.max_new_tokens, 1)
    ar, _, ar_s = run_timed(ar_generate, (target.params, batch.prompt, batch.lens, key),
                            dict(cfg=target.cfg, sampler=Sampler(),
                                 loop=loop(num_slots=batch.num_slots)))
    ar_tokens = generated(ar)
    ar_tps = sum(map(len, ar_tokens)) / ar_s
    for budget, mode in todo:
        spec = tree_spec(mode, budget, args.width, costs)
        extra = working_slots(spec.budget, draft.dcfg.block_size)
        batch = api.make_batch(target, ids, args.max_new_tokens, extra)
        (out, stats), compile_s, seconds = run_timed(
            spec_generate, (target.params, draft.params, batch.prompt, batch.lens, key),
            dict(tcfg=target.cfg, dcfg=draft.dcfg, tree_spec=spec, sampler=Sampler(),
                 loop=loop(num_slots=batch.num_slots)))
        tokens = generated(out)
        rounds = np.asarray(stats.rounds)
        accepted = np.concatenate([a[:r] for a, r in zip(np.asarray(stats.accepted), rounds)])
        nodes = np.concatenate([a[:r] for a, r in zip(np.asarray(stats.nodes), rounds)])
        tps = sum(map(len, tokens)) / seconds
        row = dict(budget=budget, mode=mode, batch=len(ids), buckets=list(spec.buckets),
                   tau=float(accepted.mean()), mean_nodes=float(nodes.mean()),
                   tokens_per_s=tps, ar_tokens_per_s=ar_tps, speedup=tps / ar_tps,
                   seconds=seconds, compile_s=compile_s, identical=tokens == ar_tokens)
        print(json.dumps(row), flush=True)
        yield row


def markdown(result: dict) -> str:
    lines = [f"# Drafting variants: {result['model']}, head {result['draft']}, "
             f"{result['device']}, {result['date']}", "",
             "; ".join(f"`{c}`" for c in result.get("commands", [result["command"]])), "",
             "| benchmark | budget | mode | tau | mean nodes | tok/s | AR tok/s | speedup | "
             "identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['benchmark']} | {r['budget']} | {r['mode']} | {r['tau']:.2f} | "
                     f"{r['mean_nodes']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    lines += ["", "Adaptive cost tables (seconds per round, by bucket): "
              + json.dumps(result["costs"])]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=api.DEFAULT_MODEL)
    ap.add_argument("--draft", required=True, help='a head directory, or "random"')
    ap.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=BENCHMARKS)
    ap.add_argument("--per-benchmark", type=int, default=16,
                    help="prompts per benchmark (the first N; all when 0)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--buckets", type=int, nargs="+", default=list(GPU_BUCKETS),
                    help="adaptive tree sizes (those <= the budget are used)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--seed", type=int, default=0, help="random head's seed")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows (and cost tables) of an existing --out .json and run "
                         "only the missing ones")
    ap.add_argument("--out", default=None,
                    help="output path without suffix (default bench/results/drafting/"
                         "drafting_<device>_<date>); writes .json and .md")
    args = ap.parse_args()
    api.decoding_options(attn_impl=args.attn_impl)  # a bad kernel name before loading
    api.exact_float32(args.dtype)
    target = api.load_target(args.model, dtype=args.dtype)
    kernels = api.resolve_kernels(target, args.attn_impl)
    draft = (random_draft(target, args.seed) if args.draft == "random"
             else api.load_draft(args.draft, target))
    device = str(jax.devices()[0].device_kind)
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out or Path(__file__).parent / "results" / "drafting"
               / f"drafting_{device.replace(' ', '_').lower()}_{date}")
    command = command_line()
    result = resume(f"{out}.json" if args.resume else None, command,
                    {"model": args.model, "draft": args.draft, "backend": jax.default_backend(),
                     "device": device, "date": date, "costs": {}, "rows": []})
    if len(result["commands"]) > 1:
        print(f"resuming {out}.json: {len(result['rows'])} rows kept", flush=True)
    buckets = tuple(b for b in sorted(args.buckets) if b <= max(args.budgets))
    for name in args.benchmarks:
        prompts = BENCHMARKS[name]()
        prompts = prompts[: args.per_benchmark] if args.per_benchmark else prompts
        ids = api.encode_prompts(target, prompts)
        context = int(np.mean([len(p) for p in ids])) + args.max_new_tokens // 2
        done = {(r["budget"], r["mode"]) for r in result["rows"] if r["benchmark"] == name}
        costs = {m: {int(b): t for b, t in table.items()}  # JSON keys are strings
                 for m, table in result["costs"].get(name, {}).items()}
        if any(MODES[m] for m in args.modes) and COSTS not in costs:
            costs[COSTS] = round_costs.measure_costs(
                target.params, target.cfg, draft.params, draft.dcfg, buckets=buckets,
                width=args.width, batch=len(ids), context_len=context, kernels=kernels)
        result["costs"][name] = costs
        for row in bench_one(target, draft, ids, args, costs, kernels, done):
            row.update(benchmark=name, num_prompts=len(ids))
            result["rows"].append(row)
            write_json(f"{out}.json", result)
    write_text(f"{out}.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
