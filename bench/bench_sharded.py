"""Tensor / expert parallel decoding against one device: greedy autoregressive and
speculative decoding of random bf16 targets of the real Qwen3-8B and Qwen3-30B-A3B shapes
(and a reference-sized random head: 5 layers, block 16, 5 taps) on a mesh of all devices and
on one device. The tokens must be equal; the table gives time per step / per round.

  python -m bench.bench_sharded                  # every device: --mesh tp=<devices>
  python -m bench.bench_sharded --out r.json     # the results as JSON to r.json
  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
    python -m bench.bench_sharded --model tiny-dense tiny-moe --mesh tp=2,ep=2 --context 64 \
    --batches 1 2 --budgets 8 16       # the CPU check with fake devices

Weights are made leaf by leaf directly in their shards (threefry is partitionable, so the
mesh and the single device get the same values). In place of a prefill the caches hold random
K/V for `--context` tokens (speed does not depend on their values; both runs start from the
same state), so no prefill is compiled. Each program is compiled once, several at a time;
time per step = (t(long run) - t(short run)) / extra steps, median of `--repeats`. Attention
is XLA's (`--attn-impl reference`): GSPMD splits it by head, not the Pallas kernels' custom
calls. `--time-budget-s` skips what is left once spent, and the table says so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import gc
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


from bench.common.results_io import command_line, write_json
from bench import trace_summary
from jetspec_jax.decode.autoregressive import decode_step
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.draft import head as draft_head
from jetspec_jax.model import config, params as P, sharding
from jetspec_jax.model.cache import KVCache
from jetspec_jax.model.kernels import choose
from jetspec_jax.model.params import is_spec
from jetspec_jax.decode.speculative import (TreeSpec, init_state, speculative_round,
                                     working_slots)

GREEDY = Sampler()
BLOCK = 16


@functools.partial(jax.jit, static_argnames=("shape", "ones", "where", "dtype"))
def random_leaf(key, shape, ones, where, dtype):
    x = jnp.ones(shape, dtype) if ones else (
        0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.lax.with_sharding_constraint(x, where)


def random_params(specs, mesh, dtype):
    """Random weights, each leaf generated in its shards (one small program per shape)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    shardings = jax.tree.leaves(sharding.param_shardings(specs, mesh))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(treedef, [random_leaf(k, s.shape, s.init == "ones", w, dtype)
                                        for s, k, w in zip(leaves, keys, shardings)])


def abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        tree, shardings)


def synthetic_state(layout, context, vocab, key):
    """`init_state`'s structure (layout: its eval_shape) with random K/V for `context` tokens
    in both caches, a random anchor and an empty output."""
    zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), t)  # noqa: E731
    k_target, k_draft, k_anchor = jax.random.split(key, 3)

    def filled(cache, key):
        arrays = cache.k + cache.v
        kv = [(0.5 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
              for k, a in zip(jax.random.split(key, len(arrays)), arrays)]
        n = len(cache.k)
        return KVCache(k=kv[:n], v=kv[n:], lengths=jnp.full(cache.lengths.shape, context,
                                                           jnp.int32))

    return layout.replace(
        cache=filled(layout.cache, k_target), draft_cache=filled(layout.draft_cache, k_draft),
        anchor=jax.random.randint(k_anchor, layout.anchor.shape, 0, vocab, jnp.int32),
        pending_taps=zeros(layout.pending_taps), pending_count=zeros(layout.pending_count),
        out=zeros(layout.out), stats=zeros(layout.stats), key=key, prompt=zeros(layout.prompt),
        prompt_lens=zeros(layout.prompt_lens))


def programs(cfg, dcfg, mesh, args):
    """Lowers every program of one mesh (in its context): per batch a state maker, the AR loop
    and one speculative loop per budget. -> {name: lowered}."""
    max_new = max(args.rounds) * BLOCK + BLOCK
    slots = args.context + max_new + working_slots(max(args.budgets), BLOCK)
    tsh = sharding.param_shardings(P.target_specs(cfg), mesh)
    dsh = sharding.param_shardings(draft_head.draft_specs(dcfg), mesh)
    tabs = abstract(P.abstract_params(P.target_specs(cfg), args.dtype), tsh)
    dabs = abstract(P.abstract_params(draft_head.draft_specs(dcfg), args.dtype), dsh)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    n_abs = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    key_abs = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)
    kernels = choose(args.attn_impl, moe=cfg.is_moe, sharded=mesh.size > 1)
    loop = Loop(max_new=max_new, num_slots=slots, kernels=kernels, cache_dtype=args.dtype)
    out = {}
    with sharding.use(mesh):
        for b in args.batches:
            layout = jax.eval_shape(lambda tp, dp: init_state(
                tp, cfg, dp, dcfg, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32),
                jax.random.key(0), sampler=GREEDY, loop=loop), tabs, dabs)
            ssh = sharding.state_shardings(layout, mesh)
            sabs = abstract(layout, ssh)
            make = jax.jit(functools.partial(synthetic_state, layout, args.context,
                                             cfg.vocab_size), out_shardings=ssh)
            out[("state", b)] = make.lower(key_abs)
            out[("ar", b)] = jax.jit(functools.partial(
                ar_loop, cfg=cfg, steps=max(args.ar_steps), kernels=kernels)).lower(
                tabs, sabs, n_abs)
            for budget in args.budgets:
                out[("spec", b, budget)] = jax.jit(functools.partial(
                    spec_loop, cfg=cfg, dcfg=dcfg, budget=budget, loop=loop)).lower(
                    tabs, dabs, sabs, n_abs)
    return out


def ar_loop(tparams, state, n, *, cfg, steps, kernels):
    """n greedy decode steps from the state's cache and anchor -> tokens [B, steps]."""
    b = state.anchor.shape[0]
    done = jnp.zeros((b,), bool)

    def body(i, carry):
        cache, last, tokens = carry
        nxt, cache = decode_step(tparams, cfg, cache, last, jax.random.key(0), GREEDY, done,
                                 kernels)
        return cache, nxt, tokens.at[:, i].set(nxt)

    carry = (state.cache, state.anchor, jnp.zeros((b, steps), jnp.int32))
    return jax.lax.fori_loop(0, n, body, carry)[2]


def spec_loop(tparams, dparams, state, n, *, cfg, dcfg, budget, loop):
    """n speculative rounds -> (tokens [B, M], num_tokens [B])."""
    round_fn = functools.partial(speculative_round, tparams, cfg, dparams, dcfg,
                                 tree_spec=TreeSpec(budget, 7), sampler=GREEDY, loop=loop)
    state = jax.lax.fori_loop(0, n, lambda i, s: sharding.constrain_state(round_fn(s)), state)
    return state.out.tokens, state.out.num_tokens


def per_step(fn, counts, repeats):
    """-> (seconds per extra step, outputs of the long run)."""
    short, long = counts

    def run(n):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(np.int32(n)))
        return time.perf_counter() - t, out

    run(short)  # warm-up
    ts, tl = [], []
    for _ in range(repeats):
        ts.append(run(short)[0])
        t, out = run(long)
        tl.append(t)
    return (statistics.median(tl) - statistics.median(ts)) / (long - short), out


def compile_all(cfg, dcfg, meshes, args):
    """Lowers and compiles every program of every mesh in one thread pool (compiles dominate
    the wall time) -> ({mesh name: {cell: compiled}}, seconds)."""
    t0 = time.perf_counter()
    lowered = {(name, cell): lo for name, mesh in meshes.items()
               for cell, lo in programs(cfg, dcfg, mesh, args).items()}
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        done = dict(zip(lowered, pool.map(lambda lo: lo.compile(), lowered.values())))
    out = {name: {} for name in meshes}
    for (name, cell), exe in done.items():
        out[name][cell] = exe
    return out, time.perf_counter() - t0


def run_mesh(cfg, dcfg, mesh, compiled, args, deadline, profile_dir=None):
    """Times every compiled program of one mesh -> {cell: (ms, tokens...)}; cells past the
    deadline are left out. With `profile_dir`, each batch's AR run is also traced there."""
    tparams = random_params(P.target_specs(cfg), mesh, args.dtype)
    dparams = random_params(draft_head.draft_specs(dcfg), mesh, args.dtype)
    results = {}
    for b in args.batches:
        state = compiled[("state", b)](sharding.replicate(jax.random.key(1), mesh))
        cells = [("ar", b)] + [("spec", b, budget) for budget in args.budgets]
        for cell in cells:
            if time.perf_counter() > deadline:
                break
            if cell[0] == "ar":
                fn = functools.partial(compiled[cell], tparams, state)
                sec, tokens = per_step(fn, args.ar_steps, args.repeats)
                results[cell] = (sec * 1e3, np.asarray(tokens))
                if profile_dir:
                    trace_dir = os.path.join(profile_dir, f"ar_b{b}")
                    print(trace_dir, trace_summary.profile(
                        fn, np.int32(max(args.ar_steps)), trace_dir=trace_dir), flush=True)
            else:
                fn = functools.partial(compiled[cell], tparams, dparams, state)
                sec, (tokens, num) = per_step(fn, args.rounds, args.repeats)
                num = np.asarray(num)
                results[cell] = (sec * 1e3, np.asarray(tokens), num)
        del state
    del tparams, dparams
    gc.collect()
    return results


def compare(model, mesh_res, one_res, args):
    rows = []
    for cell, (ms, *out) in mesh_res.items():
        one = one_res.get(cell)
        row = {"model": model, "mode": cell[0], "batch": cell[1],
               "budget": cell[2] if cell[0] == "spec" else None, "mesh_ms": ms,
               "one_ms": one and one[0], "tokens_equal": None if one is None else bool(
                   all(np.array_equal(x, y) for x, y in zip(out, one[1:])))}
        if row["tokens_equal"] is False:  # where they part: a near-tie flip or a real bug
            diff = np.argwhere(out[0] != one[1])
            row["tokens_differing"] = int(len(diff))
            row["first_difference"] = [int(i) for i in diff[0]]  # [sequence, step]
        if cell[0] == "spec":
            ar = mesh_res.get(("ar", cell[1]))
            tokens, num = out
            row["tokens_per_round"] = float(num.mean()) / max(args.rounds)
            if ar is not None:  # lossless: the first tokens equal greedy AR's, same devices
                k = min(ar[1].shape[1], int(num.min()))
                row["equals_ar"] = bool(np.array_equal(tokens[:, :k], ar[1][:, :k]))
        rows.append(row)
    return rows


def table(rows, mesh_spec) -> str:
    lines = [f"| model | batch | mode | budget | {mesh_spec} ms | 1 device ms | speedup | "
             "tokens equal | spec == AR |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        one = "skipped" if r["one_ms"] is None else f"{r['one_ms']:.2f}"
        speed = "" if r["one_ms"] is None else f"{r['one_ms'] / r['mesh_ms']:.2f}x"
        same = {None: "n/a", True: "yes", False: "NO"}[r["tokens_equal"]]
        ar = {None: "", True: "yes", False: "no"}[r.get("equals_ar")]
        unit = "step" if r["mode"] == "ar" else "round"
        lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} per {unit} | "
                     f"{r['budget'] or ''} | {r['mesh_ms']:.2f} | {one} | {speed} | {same} | "
                     f"{ar} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"],
                    help="preset names (tiny-dense / tiny-moe for a CPU check)")
    ap.add_argument("--mesh", default=None, help="mesh spec (default: tp=<device count>)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in the cache")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="keep only this many target layers (a quick float32 token check)")
    ap.add_argument("--ar-steps", type=int, nargs=2, default=[4, 36], metavar=("SHORT", "LONG"))
    ap.add_argument("--rounds", type=int, nargs=2, default=[1, 5], metavar=("SHORT", "LONG"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attn-impl", default="reference")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="weights and caches; float32 makes the token comparison exact (a "
                    "different summation order can flip bf16 near-ties)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also trace each AR run into DIR and print its per-device summary")
    ap.add_argument("--compile-threads", type=int, default=8)
    ap.add_argument("--time-budget-s", type=float, default=330.0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.dtype = jnp.dtype(args.dtype)
    if args.dtype == jnp.float32:  # true float32 dots: GPUs otherwise may use TF32, whose
        jax.config.update("jax_default_matmul_precision", "highest")  # errors flip near-ties
    spec = args.mesh or f"tp={jax.device_count()}"
    meshes = {"mesh": sharding.make_mesh(spec), "one": sharding.make_mesh("1")}
    deadline = time.perf_counter() + args.time_budget_s
    result = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(),
              "mesh": spec, "date": time.strftime("%Y-%m-%d"), "command": command_line(),
              "args": {**vars(args), "dtype": args.dtype.name}, "compile_s": {}, "rows": []}
    for model in args.model:
        cfg = config.preset(model)
        if args.num_layers:
            cfg = cfg.replace(num_layers=args.num_layers)
        dcfg = draft_head.draft_config_for(cfg, num_layers=5, block_size=BLOCK,
                                           num_taps=min(5, cfg.num_layers - 1))
        if time.perf_counter() > deadline:
            print(f"time budget: {model} skipped", flush=True)
            continue
        notes = sharding.replicated_dims(P.target_specs(cfg), meshes["mesh"].shape)
        print(model, {n: dict(m.shape) for n, m in meshes.items()}, *notes, sep="; ", flush=True)
        compiled, result["compile_s"][model] = compile_all(cfg, dcfg, meshes, args)
        res = {name: run_mesh(cfg, dcfg, mesh, compiled[name], args, deadline, args.profile and
                              os.path.join(args.profile, model, name))
               for name, mesh in meshes.items()}
        del compiled
        result["rows"] += compare(model, res["mesh"], res["one"], args)
        if args.out:
            write_json(args.out, result)
    print(table(result["rows"], spec))
    print("compile s (all programs of a model, both meshes, in parallel):",
          {k: round(v, 1) for k, v in result["compile_s"].items()})
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
