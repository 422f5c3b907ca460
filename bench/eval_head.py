"""A draft head on the full benchmark sets: tau per benchmark and budget (greedy and sampled),
whether greedy speculative output equals greedy autoregressive output, and the wall-clock
speedup at batch 1 over autoregressive decoding timed in the same run.

  python -m bench.eval_head --draft checkpoints/smollm2-135m-jetspec --dtype bfloat16 \
      --budgets 16 32 64 128 256 --temperatures 0 1 --batch1-prompts 8 --out eval.json

Answers run to the stop token or --max-new-tokens (default 512: whole answers, as users
decode them; tau grows with an answer's length, so short caps understate a head).

Tau comes from all benchmarks decoded as one ragged batch, or in --batch-size batches where
memory is short (tau does not depend on the batch);
speed from --batch1-prompts prompts of each benchmark (of one padded length) decoded one at a
time, each speculative run followed by the autoregressive run of the same prompt, per benchmark
and pooled. Benchmark prompts are
for evaluation only: never train on them.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from bench.common.prompts import BENCHMARKS
from bench.common.results_io import command_line, write_json
from jetspec_jax import api


def tau_rows(target, draft, sets, *, budgets, temperature, max_new, batch_size=0, seed=0,
             width=None, ngram=None):
    """All benchmarks decoded as one ragged batch (one compiled program per budget), or in
    batches of batch_size prompts of similar length; tau then pooled per benchmark from each
    sequence's rounds; greedy rows also check equality with AR. width, ngram: the tree's
    (None: the head's default on this machine, `api.default_tree`)."""
    pairs = [(n, p) for n, ps in sets.items() for p in ps]
    if batch_size:  # similar lengths together: less padding, few prompt buckets
        lengths = [len(ids) for ids in api.encode_prompts(target, [p for _, p in pairs])]
        pairs = [pairs[i] for i in np.argsort(lengths, kind="stable")]
    names = [n for n, _ in pairs]
    step = batch_size or len(pairs)
    batches = [[p for _, p in pairs[i:i + step]] for i in range(0, len(pairs), step)]
    rows, ar = [], None
    for b in budgets:
        runs = [api.generate(target, prompts, draft=draft, budget=b, max_new_tokens=max_new,
                             temperature=temperature, seed=seed, width=width, ngram=ngram,
                             compare_autoregressive=temperature == 0 and ar is None)
                for prompts in batches]
        accepted = [a for r in runs for a in r.accepted]
        tokens = [t for r in runs for t in r.tokens]
        if runs[0].ar_tokens is not None:
            ar = [t for r in runs for t in r.ar_tokens]
        for name in sets:
            rounds = [a for n, a in zip(names, accepted) if n == name]
            committed = [k for a in rounds for k in a]
            row = dict(benchmark=name, budget=b, temperature=temperature,
                       tau=sum(committed) / max(len(committed), 1),
                       tau_hist=np.bincount(np.asarray(committed, int)).tolist(),
                       prompts=len(rounds))
            if temperature == 0:
                same = [a == t for n, a, t in zip(names, ar, tokens) if n == name]
                row.update(identical=all(same), identical_share=float(np.mean(same)))
            rows.append(row)
    return rows


def one_bucket(target, prompts, n):
    """Up to n prompts whose encoded length shares one padding bucket, so that batch-1 runs
    reuse one compiled program per budget."""
    buckets = [api.bucket(len(ids)) for ids in api.encode_prompts(target, prompts)]
    common = max(set(buckets), key=buckets.count)
    return [p for p, b in zip(prompts, buckets) if b == common][:n]


def batch1_speed(target, draft, prompts, *, budget, max_new, width=None, ngram=None):
    """Speculative vs autoregressive seconds, summed over prompts decoded one at a time."""
    spec_s = ar_s = 0.0
    tokens, same, committed = 0, 0, []
    for p in prompts:
        r = api.generate(target, [p], draft=draft, budget=budget, max_new_tokens=max_new,
                         width=width, ngram=ngram, compare_autoregressive=True)
        spec_s += r.seconds
        ar_s += r.ar_seconds
        tokens += r.num_generated
        same += r.tokens == r.ar_tokens
        committed += r.accepted[0]
    return dict(budget=budget, prompts=len(prompts), tokens=tokens, seconds=spec_s,
                rounds=len(committed), tau=sum(committed) / max(len(committed), 1),
                ar_seconds=ar_s, speedup=ar_s / spec_s, tokens_per_s=tokens / spec_s,
                ar_tokens_per_s=tokens / ar_s, identical_share=same / len(prompts))


def pooled(rows: list[dict]) -> dict:
    """One batch-1 row of several benchmarks' rows: their seconds, tokens and rounds summed."""
    tokens = sum(r["tokens"] for r in rows)
    spec_s, ar_s = sum(r["seconds"] for r in rows), sum(r["ar_seconds"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    prompts = sum(r["prompts"] for r in rows)
    return dict(budget=rows[0]["budget"], prompts=prompts, tokens=tokens, seconds=spec_s,
                rounds=rounds, tau=sum(r["tau"] * r["rounds"] for r in rows) / max(rounds, 1),
                ar_seconds=ar_s, speedup=ar_s / spec_s, tokens_per_s=tokens / spec_s,
                ar_tokens_per_s=tokens / ar_s,
                identical_share=sum(r["identical_share"] * r["prompts"] for r in rows) / prompts)


def add_model_flags(ap, *, dtype: str) -> None:
    """--model, --draft, --dtype and --benchmarks: the target, the head and the prompt sets."""
    ap.add_argument("--model", default=api.DEFAULT_MODEL)
    ap.add_argument("--draft", default=None, help="head folder (default: the shipped head)")
    ap.add_argument("--dtype", default=dtype, choices=sorted(api.DTYPES))
    ap.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=list(BENCHMARKS))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(ap, dtype="bfloat16")
    ap.add_argument("--limit", type=int, default=0, help="prompts per benchmark (0: all)")
    ap.add_argument("--budgets", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=0,
                    help="prompts decoded together for tau (0: all in one batch)")
    ap.add_argument("--batch1-prompts", type=int, default=8,
                    help="prompts per benchmark timed at batch 1 (0: no speed measurement)")
    ap.add_argument("--batch1-budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--width", type=int, help="draft candidates per tree node (default: the "
                    "head's measured fastest on this kind of machine, else 7)")
    ap.add_argument("--ngram", type=int, help="context n-gram chain length in each tree, 0 "
                    "none (default: the head's measured fastest on this kind of machine)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.batch_size < 0:
        ap.error(f"--batch-size must be >= 0 (0: all prompts in one batch), got {args.batch_size}")
    api.exact_float32(args.dtype)
    target = api.load_target(args.model, dtype=args.dtype)
    draft = api.load_draft(args.draft or api.default_draft_path(args.model), target)
    default = api.default_tree(draft)  # recorded: a head's model card changes its tree
    tree = dict(width=default["width"] if args.width is None else args.width,
                ngram=default["ngram"] if args.ngram is None else args.ngram)
    result = dict(command=command_line(), dtype=args.dtype, device=jax.devices()[0].device_kind,
                  date=time.strftime("%Y-%m-%d"), max_new_tokens=args.max_new_tokens, tree=tree,
                  tau={}, batch1=[])
    sets = {name: BENCHMARKS[name]() for name in args.benchmarks}
    sets = {k: (v[:args.limit] if args.limit else v) for k, v in sets.items()}
    for t in args.temperatures:
        result["tau"][t] = tau_rows(target, draft, sets, budgets=args.budgets, temperature=t,
                                    max_new=args.max_new_tokens, batch_size=args.batch_size,
                                    **tree)
        write_json(args.out, result)
    if args.batch1_prompts:
        for b in args.batch1_budgets:
            rows = [dict(benchmark=name, **batch1_speed(
                target, draft, one_bucket(target, sets[name], args.batch1_prompts), budget=b,
                max_new=args.max_new_tokens, **tree)) for name in args.benchmarks]
            result["batch1"] += rows + [dict(benchmark="pooled", **pooled(rows))]
            write_json(args.out, result)
    print(f"{'benchmark':10s} {'T':>4s} " + " ".join(f"{b:>6d}" for b in args.budgets))
    for t, rows in result["tau"].items():
        for name in args.benchmarks:
            taus = [r["tau"] for r in rows if r["benchmark"] == name]
            same = all(r.get("identical", True) for r in rows if r["benchmark"] == name)
            print(f"{name:10s} {t:4.1f} " + " ".join(f"{x:6.2f}" for x in taus)
                  + ("" if t else f"  identical to AR: {same}"))
    for r in result["batch1"]:
        print(f"batch 1, {r['benchmark']}, budget {r['budget']}, {r['prompts']} prompts: "
              f"tau {r['tau']:.2f}, "
              f"{r['speedup']:.2f}x "
              f"({r['tokens_per_s']:.0f} vs {r['ar_tokens_per_s']:.0f} tok/s)")


if __name__ == "__main__":
    main()
