"""Speculative decoding on one GPU: (1) the kernels give the same tokens as the reference
attention, and speculative equals autoregressive output; (2) the cost of one speculative
round, split into its phases, against one autoregressive step, for a Qwen3-8B-shaped target
with random bf16 weights and a reference-sized head (5 layers, block 16), or (--real) a
model's own weights and shipped head.

  python -m bench.bench_speculative --out runs/spec.json
  python -m bench.bench_speculative --real --model smollm2-135m --budgets 16 64 --out s.json
Rows are written as they come; --resume (with the last call's --out carried back in) times
only the configurations that file lacks.
Projected speedups use tau from elsewhere (the paper's, or one measured on a real target):
speedup = tau * t(AR step) / t(round). They are projections, and the table says so.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp


from bench.common.models import random_params
from jetspec_jax.decode.autoregressive import ar_generate, decode_step
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import (
    TreeSpec,
    init_state,
    spec_generate,
    speculative_round,
)
from jetspec_jax.draft.tree import build_trees, topk_from_logits
from jetspec_jax.decode.verify import accept, commit, verify_tree
from jetspec_jax.draft import head as draft_head
from jetspec_jax.model import config, params as P
from jetspec_jax.model.kernels import Kernels, choose
from jetspec_jax.model.layout import fuse_projections
from bench.common.results_io import command_line, resume, write_json
from bench.common.timing import median_seconds
from bench import trace_summary

PAPER_TAU = {"MATH-500 b256": 10.76, "MT-Bench b256": 5.94}
GREEDY = Sampler()


def per_iteration(loop, *args, short=4, long=20):
    """Seconds per iteration of `loop(*args, n)` (a compiled loop of n steps): the difference
    of a long and a short run, so dispatch and argument handling cancel (median of 3 each)."""
    jax.block_until_ready(loop(*args, short))
    return (median_seconds(loop, *args, long, repeats=3, warmup=0)
            - median_seconds(loop, *args, short, repeats=3, warmup=0)) / (long - short)


def check_kernels(dtype):
    """SmolLM2-shaped random target and head: spec(kernels) vs spec(reference) vs AR."""
    tcfg = config.smollm2_135m()
    tp = jax.jit(lambda k: P.init_params(P.target_specs(tcfg), k, dtype))(jax.random.key(0))
    dcfg = draft_head.draft_config_for(tcfg, num_layers=2, block_size=8, num_taps=3)
    dp = jax.jit(lambda k: P.init_params(draft_head.draft_specs(dcfg), k, dtype))(
        jax.random.key(1))
    prompt = jax.random.randint(jax.random.key(2), (2, 96), 0, tcfg.vocab_size, jnp.int32)
    lens = jnp.array([96, 57], jnp.int32)
    loop = lambda kernels: Loop(max_new=64, num_slots=512, kernels=kernels,  # noqa: E731
                                cache_dtype=dtype)
    outs = {}
    for name, kernels in (("reference", Kernels()), ("auto", choose())):
        outs[name] = spec_generate(tp, dp, prompt, lens, jax.random.key(3), tcfg=tcfg, dcfg=dcfg,
                                   tree_spec=TreeSpec(64, 7), sampler=GREEDY,
                                   loop=loop(kernels))[0]
    ar = ar_generate(tp, prompt, lens, jax.random.key(3), cfg=tcfg, sampler=GREEDY,
                     loop=loop(choose()))
    same = lambda a, b: float(jnp.mean(a.tokens[:, :64] == b.tokens[:, :64]))  # noqa: E731
    return {"dtype": jnp.dtype(dtype).name,
            "kernels_vs_reference_token_match": same(outs["auto"], outs["reference"]),
            "speculative_vs_autoregressive_token_match": same(outs["auto"], ar)}


def peak_gb():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 1e9


def compiled(fn, *args):
    """(jitted fn compiled for args, compile seconds). Weights must be arguments, never
    closed over: jit would embed a closed-over 16 GB tree in the program as constants."""
    t0 = time.perf_counter()
    exe = jax.jit(fn).lower(*args).compile()
    return exe, time.perf_counter() - t0


def round_phases(tcfg, tp, dcfg, dp, state, spec, batch):
    """Milliseconds of draft, tree build, verify (with the target's greedy choice) and
    accept+commit, each timed inside its own compiled loop like the whole round, so dispatch
    cancels. Each iteration's input depends on the last one's output (a float zero carried
    through; XLA does not fold x * 0 for floats), so no phase is hoisted out of its loop."""
    fori = lambda n, body, carry: jax.lax.fori_loop(0, n, lambda i, c: body(c), carry)  # noqa: E731
    zero = jnp.zeros((), jnp.float32)
    active = jnp.ones((batch,), bool)
    kernels = choose(moe=tcfg.is_moe)

    def draft_logits(tp, dp, s, eps):
        taps = s.pending_taps + eps.astype(s.pending_taps.dtype)
        ctx = draft_head.extend_context(dp, dcfg, s.draft_cache, taps, s.pending_count)
        return draft_head.draft_block(dp, dcfg, tp, tcfg, ctx, s.anchor,
                                      depths=spec.draft_depths(dcfg.depth), kernels=kernels)

    def tree_of(lg, anchor, eps):
        return build_trees(anchor, *topk_from_logits(lg + eps, spec.draft_width),
                           budget=spec.budget, method=spec.method)

    def verified(tp, cache, tree):
        logits, cache, _ = verify_tree(tp, tcfg, cache, tree, taps=dcfg.tap_layers,
                                       kernels=kernels)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    dlogits = jax.jit(draft_logits)(tp, dp, state, zero)
    tree = jax.jit(tree_of)(dlogits, state.anchor, zero)
    choice, cache = jax.jit(verified)(tp, state.cache, tree)
    # A phase's whole output feeds the carried zero (a slice of it would let XLA drop work).
    total = lambda tree: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree))  # noqa: E731
    loops = {
        "draft_ms": (lambda tp, dp, s, n: fori(
            n, lambda e: total(draft_logits(tp, dp, s, e)) * 0, zero), (tp, dp, state)),
        "tree_ms": (lambda lg, a, n: fori(n, lambda e: total(tree_of(lg, a, e)) * 0, zero),
                    (dlogits, state.anchor)),
        "verify_ms": (lambda tp, c, tr, n: fori(
            n, lambda c: verified(tp, c, tr)[1], c), (tp, state.cache, tree)),
        "accept_commit_ms": (lambda ch, c, tr, n: fori(
            n, lambda c: commit(c, accept(tr, ch, dcfg.depth), active), c),
            (choice, cache, tree)),
    }
    out = {}
    for name, (loop, args) in loops.items():
        exe, _ = compiled(loop, *args, 1)
        out[name] = per_iteration(exe, *args) * 1e3
    return out


def inspect(exe, args, name: str, profile_dir: str | None, hlo_dir: str | None, n: int = 8):
    """With a profile dir, traces `n` iterations of the compiled loop and prints where the
    device spent its time; with an HLO dir, writes the optimised program (the trace names its
    fusions) gzipped there."""
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        with gzip.open(Path(hlo_dir) / f"{name}.hlo.txt.gz", "wt") as f:
            f.write(exe.as_text())
    if profile_dir:
        trace_dir = str(Path(profile_dir) / name)
        print(f"{name} ({n} iterations):",
              trace_summary.profile(exe, *args, n, trace_dir=trace_dir, top=25), flush=True)


def time_round(tcfg, tp, dcfg, dp, context, budgets, batch, phases: bool, deadline: float,
               profile_dir=None, hlo_dir=None, width=7, ngram=0, cache_dtype=jnp.bfloat16):
    """One AR step and one whole speculative round per budget, each timed inside a compiled
    loop (as `spec_generate` and `ar_generate` run them); with phases, also the round's parts,
    each in its own compiled loop. Yields one row per budget; budgets past the deadline
    (perf_counter) are skipped, and so is the whole batch (its AR loop too) when it starts
    past it."""
    tag = f"{tcfg.name}_b{batch}_s{context}"
    if time.perf_counter() > deadline:
        print(f"time budget spent: skipping {tag}", flush=True)
        return
    num_slots = context + 1024
    prompt = jax.random.randint(jax.random.key(2), (batch, context), 0, tcfg.vocab_size,
                                jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    kernels = choose(moe=tcfg.is_moe)
    loop = Loop(max_new=512, num_slots=num_slots, kernels=kernels, cache_dtype=cache_dtype)
    make_state = jax.jit(lambda tp, dp, prompt, lens, key: init_state(
        tp, tcfg, dp, dcfg, prompt, lens, key, sampler=GREEDY, loop=loop))
    state = make_state(tp, dp, prompt, lens, jax.random.key(0))
    jax.block_until_ready(state)
    done = jnp.zeros((batch,), bool)

    def ar_steps(tp, cache, last, n):
        step = lambda i, c: decode_step(tp, tcfg, c[1], c[0], jax.random.key(0), GREEDY, done,  # noqa: E731
                                        kernels)
        return jax.lax.fori_loop(0, n, step, (last, cache))

    ar, ar_compile = compiled(ar_steps, tp, state.cache, state.anchor, 1)
    t_ar = per_iteration(ar, tp, state.cache, state.anchor)
    if phases:
        inspect(ar, (tp, state.cache, state.anchor), f"ar_{tag}", profile_dir, hlo_dir)
    for budget in budgets:
        if time.perf_counter() > deadline:
            print(f"time budget spent: skipping {tag} budget {budget}", flush=True)
            continue
        spec = TreeSpec(budget, width, ngram=ngram)
        one_round = functools.partial(speculative_round, tree_spec=spec, sampler=GREEDY,
                                      loop=loop)
        rounds = lambda tp, dp, s, n: jax.lax.fori_loop(  # noqa: E731
            0, n, lambda i, s: one_round(tp, tcfg, dp, dcfg, s), s)
        round_fn, compile_s = compiled(rounds, tp, dp, state, 1)
        t_round = per_iteration(round_fn, tp, dp, state)
        row = {"model": tcfg.name, "batch": batch, "context": context, "budget": budget,
               "ar_step_ms": t_ar * 1e3, "ar_compile_s": ar_compile, "round_ms": t_round * 1e3,
               "round_over_ar": t_round / t_ar, "round_compile_s": compile_s,
               "projected_speedup": {k: tau * t_ar / t_round for k, tau in PAPER_TAU.items()}}
        if phases:
            row.update(round_phases(tcfg, tp, dcfg, dp, state, spec, batch))
            inspect(round_fn, (tp, dp, state), f"round{budget}_{tag}", profile_dir, hlo_dir, 4)
        row["peak_gb"] = peak_gb()
        print(json.dumps(row), flush=True)
        yield row


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--batch-budgets", nargs="*", default=[], metavar="B:N,N",
                    help="budgets for one batch size instead of --budgets, e.g. 32:16,32,64")
    ap.add_argument("--phase-batches", type=int, nargs="*", default=[1],
                    help="batch sizes whose rounds are also split into phases")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--model", default="qwen3-8b", help="preset name of the timed target")
    ap.add_argument("--real", action="store_true",
                    help="the model's real weights and its shipped head (e.g. --model "
                         "smollm2-135m), not random ones of a preset and a reference-sized head")
    ap.add_argument("--dtype", default="bfloat16", help="weights and caches with --real")
    ap.add_argument("--width", type=int, default=7, help="tree fan-out")
    ap.add_argument("--ngram", type=int, default=0, help="context chain of up to L tokens")
    ap.add_argument("--layout", choices=["separate", "fused"], default="separate",
                    help="target weights as loaded, or with q/k/v and gate/up concatenated "
                         "(jetspec_jax.model.layout)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--time-budget-s", type=float, default=float("inf"),
                    help="skip the configurations that would start after this many seconds")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="trace the AR loop and each round loop of the phase batches into DIR "
                         "and print where the device spent its time")
    ap.add_argument("--dump-hlo", default=None, metavar="DIR",
                    help="write those loops' optimised HLO (gzipped) into DIR")
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of an existing --out and time only the missing "
                         "(model, context, batch, budget) configurations")
    args = ap.parse_args()
    deadline = time.perf_counter() + args.time_budget_s
    result = resume(args.out if args.resume else None, command_line(),
                    {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
                     "layout": args.layout, "weights": "real" if args.real else "random",
                     "checks": [], "rows": []})
    stored = result.get("layout", "separate")  # files from before the option: separate
    if stored != args.layout:
        ap.error(f"--resume: {args.out} holds rows of the {stored} layout, not {args.layout}")
    done = {(r["model"], r["context"], r["batch"], r["budget"]) for r in result["rows"]}
    if not args.skip_check:
        for dtype in (jnp.float32, jnp.bfloat16):
            result["checks"].append(check_kernels(dtype))
            print(json.dumps(result["checks"][-1]), flush=True)
    if args.real:
        from jetspec_jax import api

        target = api.load_target(args.model, dtype=args.dtype)
        draft = api.load_draft(api.default_draft_path(args.model), target)
        tcfg, tp, dcfg, dp = target.cfg, target.params, draft.dcfg, draft.params
    else:
        tcfg = config.preset(args.model)
        tp = random_params(P.target_specs(tcfg))
        dcfg = draft_head.draft_config_for(tcfg, num_layers=5, block_size=16, num_taps=5)
        dp = random_params(draft_head.draft_specs(dcfg))
    if args.layout == "fused":  # q/k/v and gate/up concatenated (jetspec_jax.model.layout)
        tp = jax.block_until_ready(jax.jit(fuse_projections)(tp))
    per_batch = {int(b): [int(n) for n in ns.split(",")] for b, ns in
                 (x.split(":") for x in args.batch_budgets)}
    for context in args.contexts:
        for batch in args.batches:
            budgets = [n for n in per_batch.get(batch, args.budgets)
                       if (tcfg.name, context, batch, n) not in done]
            if not budgets:  # all resumed: no AR loop to compile either
                continue
            for row in time_round(tcfg, tp, dcfg, dp, context, budgets,
                                  batch, batch in args.phase_batches, deadline, args.profile,
                                  args.dump_hlo, args.width, args.ngram,
                                  jnp.dtype(args.dtype) if args.real else jnp.bfloat16):
                result["rows"].append(row)
                if args.out:
                    write_json(args.out, result)
    print("| context | batch | budget | AR step ms | draft | tree | verify | accept+commit | "
          "round ms | round/AR | projected x (tau 10.76) | projected x (tau 5.94) | "
          "round compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ms = lambda r, k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
    for r in result["rows"]:
        p = r["projected_speedup"]
        print(f"| {r['context']} | {r['batch']} | {r['budget']} | {r['ar_step_ms']:.2f} | "
              f"{ms(r, 'draft_ms')} | {ms(r, 'tree_ms')} | {ms(r, 'verify_ms')} | "
              f"{ms(r, 'accept_commit_ms')} | {r['round_ms']:.2f} | {r['round_over_ar']:.2f} | "
              f"{p['MATH-500 b256']:.2f} | {p['MT-Bench b256']:.2f} | "
              f"{r['round_compile_s']:.1f} |")


if __name__ == "__main__":
    main()
