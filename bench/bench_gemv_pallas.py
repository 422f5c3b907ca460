"""Small-M weight streaming on one GPU: the split-K Pallas kernels (`pallas_kernels.gemv`)
against XLA, per projection shape (Qwen3-8B dense, Qwen3-30B-A3B experts) and in whole decode
steps, in one process.

  python -m bench.bench_gemv_pallas --out runs/gemv.json --write-table runs/tuned_h200.json \
      --no-decode --ms 1 4 --sweep 4 --budget-s 150                       # H200 sweep, ~3 min
  python -m bench.bench_gemv_pallas --decode-only --out runs/steps.json # H200 steps, ~200 s
  python -m bench.bench_gemv_pallas --write-table pallas_kernels/gemv/tuned_h200.json \
      --table-from bench/results/gemv/gemv_pallas_h200_2026-11-29.json    # table from a result
  JAX_PLATFORMS=cpu python -m bench.bench_gemv_pallas --quick --out /tmp/g.json   # CPU check

(a) correctness: every timed variant's output (sum over a stack of fresh random bf16 weights)
    against the float32 reference: max |error| / max |reference|.
(b) per shape [K, N] and rows M: a stack of L layers' weights (about --stack-gb read in all,
    beyond the 50 MB L2) multiplied layer after layer, `reps` times, inside one jitted
    fori_loop; the time per matmul is (t(reps) - t(1)) / ((reps - 1) * L), so dispatch cancels
    (medians of --repeats calls). XLA and a small sweep of kernel configs (the first is the
    heuristic default). Dense: `jnp.dot` vs `small_m_matmul_pallas`; MoE experts [E, K, N]
    with P = M distinct chosen experts: the gather + einsum vs `grouped_small_m_matmul_pallas`
    (bytes: the P experts' weights). M = 1 (P = 8 for MoE) first, then the decode steps, then
    the larger M while --budget-s lasts. --write-table: the dense shapes where the best
    config beat XLA by more than --margin, as the table the matmul kernel "tuned" reads
    (`pallas_kernels/gemv/tuned_<gpu>.json`).
(c) decode steps (random bf16 weights made leaf by leaf, ctx --context, batch 1), matmul kernel
    (`Kernels.matmul`, the rows' "matmul_impl") xla / tuned / pallas for Qwen3-8B and
    Qwen3-30B-A3B (30B: "tuned" = XLA dense + the grouped MoE kernel, "pallas" = both
    kernels) (`bench_decode.time_model`: per-token time
    from the difference of two loop lengths), ms/token and TB/s over weights + KV. "tuned"
    reads the table committed for this GPU (pallas_kernels/gemv/tuned_h200.json).
Percentages are of PEAK_TBPS, the weight-streaming bandwidth measured on the H200
(../shared/gpu.md). Tables (markdown) are printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import platform
import time
import traceback
from pathlib import Path


from bench.common.results_io import command_line, write_json
from bench.common.timing import chained_matmuls, loop_seconds

PEAK_TBPS = 4.25
# Qwen3-8B decode projections, [K, N] (weights row-major, N contiguous); q and o, k and v,
# gate and up share shapes.
SHAPES = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 12288),
          "down": (12288, 4096), "lm_head": (4096, 151936)}
ERR_TOL = 2e-2  # max |err| / max |ref| of a sum of L bf16-rounded outputs
QUICK_SHAPES = {"q/o": (256, 256), "k/v": (256, 64), "lm_head": (200, 1000)}
# Qwen3-30B-A3B experts, [E, K, N]; M = P (token, expert) pairs: 8 at batch 1.
GROUPED_SHAPES = {"moe gate/up": (128, 2048, 768), "moe down": (128, 768, 2048)}
GROUPED_PAIRS = {1: 8, 4: 32}  # dense M (batch rows) -> pairs at top-8
QUICK_GROUPED = {"moe gate/up": (8, 64, 48)}
# Decode steps: model -> matmul kernels timed (in this order, same process).
# 30B "tuned": XLA for its dense shapes (none in the table) + the grouped MoE kernel, which
# isolates the MoE kernel; "pallas" adds the dense kernel on 30B's (unmeasured) shapes.
DECODE = {"qwen3-8b": ("xla", "tuned", "pallas"),
          "qwen3-30b-a3b": ("xla", "tuned", "pallas")}
QUICK_DECODE = {"tiny-dense": ("xla", "tuned", "pallas"), "tiny-moe": ("xla", "pallas")}


def sweep_configs(m, k, n, limit, grouped=False):
    """The heuristic default first, then variations of one knob each."""
    from pallas_kernels import common
    from pallas_kernels.gemv.config import gemv_config, grouped_config

    base = grouped_config(m, k, n) if grouped else gemv_config(m, k, n)
    r = functools.partial(dataclasses.replace, base)
    cands = [base]
    if grouped:  # one row per pair: broadcast-reduce into a [block_k, block_n] accumulator
        cands.append(r(use_dot=False))
    elif m <= 4:  # broadcast-reduce form: [rows, block_k, block_n] float32 accumulator
        cands.append(r(use_dot=False, block_k=max(16, 64 // common.next_pow2(m)), num_warps=8))
    cands += [
        r(num_stages=4),
        r(num_splits=2 * base.num_splits),
        r(block_n=2 * base.block_n if base.block_n < 128 else base.block_n // 2),
        r(num_warps=8),
        r(block_k=64, num_stages=5),
        r(evict_first=False),
    ]
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out[:limit]


def time_variant(mm, ws, x, ref, args):
    """-> (seconds per matmul, max rel err of the reps=1 output against ref, compile s)."""
    import numpy as np

    per, compile_s, once = loop_seconds(chained_matmuls(mm), ws, x, reps=args.reps,
                                        repeats=args.repeats)
    err = float(np.max(np.abs(np.asarray(once) - ref)) / np.max(np.abs(ref)))
    return per / len(ws), err, compile_s


def record(rows, row, measure):
    """Adds measure()'s results to row, or the error that stopped it (one failing variant
    must not stop the run), then keeps and prints the row."""
    try:
        row.update(measure())
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=2)
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_shape(name, k, n, ms, args, deadline, rows, num_experts=0):
    """Times XLA and the kernel sweep for one weight shape at each M in ms (until deadline).
    num_experts > 0: MoE experts w [E, K, N], M distinct chosen ones (the grouped kernel)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.gemv.api import _xla_grouped
    from pallas_kernels.gemv.grouped import grouped_small_m_matmul_pallas
    from pallas_kernels.gemv.kernel import small_m_matmul_pallas

    grouped = num_experts > 0
    out_dtype = jnp.float32 if name == "lm_head" else None  # the model's logits are float32
    w_shape = (num_experts, k, n) if grouped else (k, n)
    read_bytes = k * n * 2 * (max(ms) if grouped else 1)  # per matmul, at the largest M
    layer_gb = math.prod(w_shape) * 2 / 1e9
    num_layers = max(1, min(args.max_layers, round(args.stack_gb * 1e9 / read_bytes),
                            int(args.max_stack_gb / layer_gb)))
    keys = jax.random.split(jax.random.key(k * 31 + n), num_layers + 2)
    ws = [jax.random.normal(kk, w_shape, jnp.bfloat16) for kk in keys[:num_layers]]
    for m in ms:
        if time.perf_counter() > deadline:
            print(f"budget spent: skipping {name} M={m}", flush=True)
            continue
        x = jax.random.normal(jax.random.fold_in(keys[-1], m), (m, k), jnp.bfloat16)
        x32 = x.astype(jnp.float32)
        if grouped:  # distinct experts, as one token's top-k
            experts = jax.random.permutation(keys[-2], num_experts)[:m].astype(jnp.int32)
            ref = sum(np.asarray(jnp.einsum("pk,pkn->pn", x32, w[experts].astype(jnp.float32),
                                            precision=jax.lax.Precision.HIGHEST)) for w in ws)
        else:
            ref = sum(np.asarray(jnp.dot(x32, w.astype(jnp.float32),
                                         precision=jax.lax.Precision.HIGHEST)) for w in ws)
        variants = [("xla", None)] + [("pallas", c) for c in
                                      sweep_configs(m, k, n, args.sweep, grouped=grouped)]
        for i, (impl, cfg) in enumerate(variants):
            if time.perf_counter() > deadline:
                break
            row = {"shape": name, "kernel": "grouped" if grouped else "gemv", "K": k, "N": n,
                   "M": m, "E": num_experts or None, "dtype": "bfloat16", "layers": num_layers,
                   "impl": impl, "config": dataclasses.asdict(cfg) if cfg else None,
                   "default": i == 1}
            if grouped and impl == "xla":
                mm = lambda x, w: _xla_grouped(x, w, experts, out_dtype)  # noqa: E731
            elif grouped:
                mm = lambda x, w, cfg=cfg: grouped_small_m_matmul_pallas(  # noqa: E731
                    x, w, experts, out_dtype=out_dtype, config=cfg, interpret=args.interpret)
            elif impl == "xla":
                mm = lambda x, w: jnp.dot(x, w, preferred_element_type=out_dtype)  # noqa: E731
            else:
                mm = lambda x, w, cfg=cfg: small_m_matmul_pallas(  # noqa: E731
                    x, w, out_dtype=out_dtype, config=cfg, interpret=args.interpret)

            def measure(mm=mm):
                sec, err, compile_s = time_variant(mm, ws, x, ref, args)
                tbps = k * n * 2 * (m if grouped else 1) / sec / 1e12
                return dict(us=sec * 1e6, TBps=tbps, rel_err=err, compile_s=compile_s,
                            pct_peak=100 * tbps / PEAK_TBPS)

            record(rows, row, measure)
    del ws
    jax.clear_caches()


def bench_decode_steps(models, args):
    """Whole decode steps, per model (random weights built once) and matmul kernel, same
    process. A failing variant is recorded and the rest go on."""
    import jax

    from bench.bench_decode import time_model
    from bench.common.models import random_params, weight_bytes_per_token
    from jetspec_jax.model import config, params as P
    from jetspec_jax.model.kernels import choose

    rows = []
    for name, impls in models.items():
        cfg = config.preset(name)
        t = time.perf_counter()
        params = random_params(P.target_specs(cfg))
        jax.block_until_ready(params)
        print(f"{name}: random weights in {time.perf_counter() - t:.1f} s", flush=True)
        for impl in impls:
            try:
                kernels = dataclasses.replace(  # CPU: the kernels in interpret mode
                    choose(args.attn_impl, impl, moe=cfg.is_moe), interpret=args.interpret)
                row = time_model(cfg, params, args.context, kernels, PEAK_TBPS * 1e12)
                row.update(matmul_impl=impl, weight_TBps=weight_bytes_per_token(cfg)
                           / (row["ms_per_token"] * 1e-3) / 1e12)
            except Exception as e:
                row = {"model": cfg.name, "matmul_impl": impl,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
                traceback.print_exc(limit=2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del params
        jax.clear_caches()
    return rows


def tuned_table(rows, margin, device):
    """The table of matmul kernel "tuned": per dense (K, N, M), the best correct kernel config
    where it beat XLA's time by more than `margin` (0.03: 3%)."""
    entries = []
    for (k, n, m), group in _groups(r for r in rows if r.get("kernel", "gemv") == "gemv"):
        xla = next((r for r in group if r["impl"] == "xla" and _timed(r)), None)
        ok = [r for r in group if r["impl"] == "pallas" and _timed(r)
              and r["rel_err"] <= ERR_TOL]
        best = max(ok, key=lambda r: r["TBps"], default=None)
        if xla and best and best["TBps"] > (1 + margin) * xla["TBps"]:
            entries.append({"kernel": "gemv", "shape": best["shape"], "K": k, "N": n, "M": m,
                            "dtype": best.get("dtype", "bfloat16"), "config": best["config"],
                            "TBps": round(best["TBps"], 3), "xla_TBps": round(xla["TBps"], 3)})
    return {"device": device, "source": "bench/bench_gemv_pallas.py", "margin": margin,
            "entries": entries}


def _groups(rows):
    out = {}
    for r in rows:
        out.setdefault((r["K"], r["N"], r["M"]), []).append(r)
    return out.items()


def fmt_cfg(c):
    if c is None:
        return ""
    form = "dot" if c["use_dot"] else "reduce"
    return (f"{c['block_k']}x{c['block_n']} s{c['num_splits']} w{c['num_warps']} "
            f"st{c['num_stages']} {form}{'' if c['evict_first'] else ' keep'}")


def _timed(r):
    return math.isfinite(r.get("TBps", math.nan))


def _cell(r):
    return f"{r['TBps']:.2f} ({r['pct_peak']:.0f}%)" if r and _timed(r) else "-"


def report(result):
    rows = [r for r in result["rows"] if "rel_err" in r]  # ran (timed or not)
    lines = [f"device: {result['device']}, {result['date']}; % of {PEAK_TBPS} TB/s", "",
             "| shape [K, N] | M | layers | XLA TB/s (%) | Pallas default TB/s (%) | "
             "best Pallas TB/s (%) | best config | max rel err |",
             "|---|---|---|---|---|---|---|---|"]
    groups = sorted(dict.fromkeys((r["shape"], r["M"]) for r in rows), key=lambda g: g[1])
    for shape, m in groups:
        group = [r for r in rows if (r["shape"], r["M"]) == (shape, m)]
        xla = next((r for r in group if r["impl"] == "xla"), None)
        pal = [r for r in group if r["impl"] == "pallas"]
        default = next((r for r in pal if r["default"]), None)
        best = max(filter(_timed, pal), key=lambda r: r["TBps"], default=None)
        err = max((r["rel_err"] for r in group if r["impl"] != "xla"), default=math.nan)
        g = group[0]
        experts = f"{g['E']} x " if g.get("E") else ""
        lines.append(f"| {shape} [{experts}{g['K']}, {g['N']}] | {m} | {g['layers']} | "
                     f"{_cell(xla)} | "
                     f"{_cell(default)} | {_cell(best)} | "
                     f"{fmt_cfg(best['config']) if best else ''} | {err:.1e} |")
    wrong = [r for r in rows if not r["rel_err"] <= ERR_TOL]
    lines.append(f"\ncorrectness: {len(rows) - len(wrong)} of {len(rows)} variants within "
                 f"rel err {ERR_TOL}" + "".join(f"; WRONG: {r['shape']} M={r['M']} {r['impl']} "
                                                 f"{fmt_cfg(r['config'])}" for r in wrong[:5]))
    failed = [r for r in result["rows"] if "error" in r]
    if failed:
        f = failed[0]
        lines.append(f"\n{len(failed)} variants failed, e.g. {f['shape']} M={f['M']} "
                     f"{fmt_cfg(f['config'])}: {f['error'][:200]}")
    lines += ["", "| decode step | matmul | ms/token | vs xla | tok/s | TB/s (weights + KV) | "
              f"% of {PEAK_TBPS} | weights-only TB/s |", "|---|---|---|---|---|---|---|---|"]
    xla_ms = {r["model"]: r["ms_per_token"] for r in result["decode"]
              if r.get("matmul_impl") == "xla" and "ms_per_token" in r}
    for r in result["decode"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['matmul_impl']} | error: {r['error'][:80]} "
                         "||||||")
            continue
        ratio = xla_ms.get(r["model"], math.nan) / r["ms_per_token"]
        lines.append(f"| {r['model']} ctx {r['context']} | {r['matmul_impl']} | "
                     f"{r['ms_per_token']:.3f} | {ratio:.2f}x | {r['tok_s']:.0f} | "
                     f"{r['achieved_TBps']:.2f} | {100 * r['achieved_TBps'] / PEAK_TBPS:.0f}% | "
                     f"{r['weight_TBps']:.2f} |")
    print("\n".join(lines))


def add_timing_options(parser, decode):
    """Timing loop lengths and the decode steps (decode: model -> matmul kernels)."""
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--attn-impl", default="auto")
    parser.add_argument("--no-decode", action="store_true", help="per-shape sweep only")
    parser.add_argument("--decode-only", action="store_true", help="decode steps only")
    parser.add_argument("--decode-models", nargs="+", default=list(decode),
                        help=f"models of the decode steps, of {list(decode)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and models, few repeats (CPU check of the script)")
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--sweep", type=int, default=7, help="kernel configs per shape and M")
    parser.add_argument("--stack-gb", type=float, default=1.1, help="weights read per rep")
    parser.add_argument("--max-stack-gb", type=float, default=8.0, help="weights allocated")
    parser.add_argument("--max-layers", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=210, help="for the shape sweep")
    add_timing_options(parser, DECODE)
    parser.add_argument("--write-table", default=None,
                        help="write the tuned table (dense shapes where the kernel won) here")
    parser.add_argument("--margin", type=float, default=0.03,
                        help="a table entry needs the kernel this much faster than XLA")
    parser.add_argument("--table-from", default=None,
                        help="only write --write-table from the rows of this earlier --out")
    args = parser.parse_args()

    if args.table_from:
        old = json.loads(Path(args.table_from).read_text())
        table = tuned_table(old["rows"], args.margin, old["device"])
        table["source"] += f" --table-from {Path(args.table_from).name}"
        write_json(args.write_table, table)
        print(json.dumps(table["entries"], indent=1))
        return

    import jax

    args.interpret = jax.default_backend() != "gpu"  # CPU: the kernels in interpret mode
    shapes, grouped, decode_models = SHAPES, GROUPED_SHAPES, {m: DECODE[m]
                                                              for m in args.decode_models}
    if args.quick:
        shapes, grouped, decode_models = QUICK_SHAPES, QUICK_GROUPED, QUICK_DECODE
        args.ms = [m for m in args.ms if m <= 4] or [1]
        args.sweep, args.stack_gb, args.max_layers = 2, 1e-3, 2
        args.reps, args.repeats, args.context = 3, 2, 16
    if args.decode_only:
        shapes, grouped = {}, {}
    start = time.perf_counter()
    rows = []
    first, rest = args.ms[:1], args.ms[1:]

    def sweep(ms, deadline):
        for name, (k, n) in shapes.items():
            bench_shape(name, k, n, ms, args, deadline, rows)
        for name, (e, k, n) in grouped.items():
            done = {r["M"] for r in rows if r["shape"] == name}
            pairs = sorted({min(GROUPED_PAIRS.get(m, 32), e) for m in ms} - done)
            if pairs:
                bench_shape(name, k, n, pairs, args, deadline, rows, num_experts=e)

    # M = 1 (batch-1 decode) for every shape first, then the decode steps, then larger M.
    sweep(first, start + 0.45 * args.budget_s)
    swept_s = time.perf_counter() - start
    decode = [] if args.no_decode else bench_decode_steps(decode_models, args)
    sweep(rest, time.perf_counter() + args.budget_s - swept_s - 10)
    device = str(jax.devices()[0].device_kind)
    result = {"rows": rows, "decode": decode, "device": device,
              "date": time.strftime("%Y-%m-%d"), "command": command_line(),
              "host": platform.node(), "peak_TBps": PEAK_TBPS,
              "wall_s": time.perf_counter() - start}
    if args.out:
        write_json(args.out, result)
    if args.write_table:
        table = tuned_table(rows, args.margin, device)
        write_json(args.write_table, table)
        print(f"tuned table: {len(table['entries'])} entries -> {args.write_table}")
    report(result)


if __name__ == "__main__":
    main()
