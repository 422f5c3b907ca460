"""Tree shapes and context n-gram chains at batch 1: tau and speedup over autoregressive
decoding of the shipped head with trees of several budgets and widths, with and without
chains in them, and of the n-gram drafter alone (prompt lookup, no head), on a few prompts of
each benchmark set.

  python -m bench.bench_ngram --dtype float32 --prompts 4 --max-new-tokens 128 \
      --configs head:4 head:4:3 head:16 head:16:8 ngram:4 --out bench/results/ngram/cpu.json

A config is head:BUDGET[:L][:wWIDTH] (the head's tree of BUDGET nodes, WIDTH children a node
at most (default 7), with a chain of up to L tokens) or ngram:L (the n-gram drafter, chains
of L tokens, trees of L + 1 nodes). Each prompt is decoded autoregressively once, then with
every config, back to back in one process; speedup = the prompts' autoregressive seconds over
the config's seconds (compilation excluded).
"""

from __future__ import annotations

import argparse
import time

import jax

from bench.common.prompts import BENCHMARKS
from bench.common.results_io import command_line, write_json
from bench.eval_head import add_model_flags, one_bucket
from jetspec_jax import api


def parse_config(text: str) -> dict:
    kind, *fields = text.split(":")
    is_width = [f.startswith("w") and f[1:].isdigit() for f in fields]
    width = [int(f[1:]) for f, w in zip(fields, is_width) if w]
    nums = [f for f, w in zip(fields, is_width) if not w]
    if kind == "head" and len(nums) in (1, 2) and len(width) <= 1 and all(map(str.isdigit, nums)):
        return dict(name=text, kind=kind, budget=int(nums[0]), width=width[0] if width else 7,
                    ngram=int(nums[1]) if len(nums) == 2 else 0)
    if kind == "ngram" and len(nums) == 1 and not width and nums[0].isdigit():
        return dict(name=text, kind=kind, budget=int(nums[0]) + 1, width=1, ngram=int(nums[0]))
    raise argparse.ArgumentTypeError(
        f"config must be head:BUDGET[:L][:wWIDTH] or ngram:L, got {text!r}")


def run_set(target, head, prompts, configs, max_new):
    """-> {config name or "ar": {seconds, tokens, rounds, committed, identical}} summed."""
    sums = {c["name"]: dict(seconds=0.0, tokens=0, rounds=0, committed=0, identical=0)
            for c in [dict(name="ar"), *configs]}
    for p in prompts:
        ar = api.generate(target, [p], max_new_tokens=max_new)
        sums["ar"]["seconds"] += ar.seconds
        sums["ar"]["tokens"] += ar.num_generated
        for c in configs:
            draft = head if c["kind"] == "head" else api.ngram_draft(c["ngram"])
            r = api.generate(target, [p], draft=draft, budget=c["budget"], width=c["width"],
                             max_new_tokens=max_new,
                             ngram=c["ngram"] if c["kind"] == "head" else 0)
            s = sums[c["name"]]
            s["seconds"] += r.seconds
            s["tokens"] += r.num_generated
            s["rounds"] += sum(r.rounds)
            s["committed"] += sum(map(sum, r.accepted))
            s["identical"] += r.tokens == ar.tokens
    return sums


def rows_of(name, sums, configs, prompts):
    ar = sums["ar"]
    return [dict(benchmark=name, config=c["name"], prompts=prompts, **sums[c["name"]],
                 tau=sums[c["name"]]["committed"] / max(sums[c["name"]]["rounds"], 1),
                 speedup=ar["seconds"] / sums[c["name"]]["seconds"],
                 ar_seconds=ar["seconds"]) for c in configs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(ap, dtype="float32")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", type=parse_config, nargs="+",
                    default=[parse_config(c) for c in ("head:4", "head:4:3", "ngram:4")])
    ap.add_argument("--note", default="", help="recorded with the results")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    api.exact_float32(args.dtype)
    target = api.load_target(args.model, dtype=args.dtype)
    head = api.load_draft(args.draft or api.default_draft_path(args.model), target)
    result = dict(command=command_line(), dtype=args.dtype, device=jax.devices()[0].device_kind,
                  date=time.strftime("%Y-%m-%d"), max_new_tokens=args.max_new_tokens,
                  note=args.note, rows=[])
    for name in args.benchmarks:
        prompts = one_bucket(target, BENCHMARKS[name](), args.prompts)
        sums = run_set(target, head, prompts, args.configs, args.max_new_tokens)
        result["rows"] += rows_of(name, sums, args.configs, len(prompts))
        write_json(args.out, result)
    pooled = {}
    for r in result["rows"]:
        p = pooled.setdefault(r["config"], dict(seconds=0.0, ar_seconds=0.0, rounds=0,
                                                committed=0))
        for k in p:
            p[k] += r[k]
    result["pooled"] = {c: dict(tau=p["committed"] / max(p["rounds"], 1),
                                speedup=p["ar_seconds"] / p["seconds"]) for c, p in pooled.items()}
    write_json(args.out, result)
    print(f"{'benchmark':10s} {'config':12s} {'tau':>5s} {'speedup':>8s} identical")
    for r in result["rows"]:
        print(f"{r['benchmark']:10s} {r['config']:12s} {r['tau']:5.2f} {r['speedup']:7.2f}x "
              f"{r['identical']}/{r['prompts']}")
    for c, p in result["pooled"].items():
        print(f"{'pooled':10s} {c:12s} {p['tau']:5.2f} {p['speedup']:7.2f}x")


if __name__ == "__main__":
    main()
