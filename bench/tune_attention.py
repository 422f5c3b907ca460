"""Config sweep of the attention kernels on one GPU, within a wall-clock budget.

Shapes (Qwen3-8B heads: 32 query / 8 KV heads, dim 128, bf16, prefix_len = S - T so the whole
cache is visible), most important first: verify T in {16, 64, 256} x S in {2048, 8192, 32768}
(batch 1, random tree masks) and decode T=1 x S in {8192, 32768} at batch 1 and 8. Per shape
it sweeps <= 8 configs of each kernel (portable and Mosaic for verify, the split-K decode
kernel for decode; the heuristic config first) beside the XLA reference, cuDNN
(jax.nn.dot_product_attention with the dense mask) and a null chain (harness overhead).

Each candidate is compiled ahead of time in a thread pool (--workers), run once and checked
against the float32 XLA reference on the same inputs (wrong ones are recorded, not timed),
then timed as the median per call of --unroll chained calls inside one jit (as
bench_attention.py does). Timings taken while other candidates compile are re-taken at the
end with the pool stopped ("quiet"); tables use the quiet figure where there is one.

Budget: no new work starts after --budget-s minus a reserve for the quiet pass; a candidate
that runs (or compiles) longer than --hang-s is recorded and the run stops there (GPU hang:
results so far are written, then the process exits).

Outputs: --out JSON with every candidate; `<tables-dir>/{tree,decode}_attention/tuned_<gpu>.json`
with the winners that beat the heuristic by > 3% (copy them into pallas_kernels/ to use
them: see `common.tuned_config`); a markdown table printed last.

  python -m bench.tune_attention --out runs/tune_attention.json          # GPU, ~270 s
  JAX_PLATFORMS=cpu python -m bench.tune_attention --interpret --quick    # CPU smoke test
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import os
import time
import traceback
from pathlib import Path


from bench import bench_attention as ba
from bench.common.results_io import write_json
from bench.common.timing import median_seconds

PEAK_FLOPS = 989e12  # H200 dense bf16
SHAPES = [  # (op, B, T, S), most important first
    ("verify", 1, 16, 32768), ("verify", 1, 256, 8192), ("decode", 1, 1, 32768),
    ("verify", 1, 16, 8192), ("verify", 1, 256, 32768), ("decode", 8, 1, 32768),
    ("verify", 1, 64, 8192), ("verify", 1, 64, 32768), ("verify", 1, 256, 2048),
    ("verify", 1, 16, 2048), ("verify", 1, 64, 2048), ("decode", 1, 1, 8192),
    ("decode", 8, 1, 8192),
]
QUICK_SHAPES = SHAPES[:6]
HEADS = dict(n=32, kh=8, h=128)
TINY_HEADS = dict(n=8, kh=2, h=64)  # --interpret: kernels in interpret mode on CPU
TINY_SHAPES = [("verify", 1, 16, 256), ("verify", 2, 37, 256), ("decode", 2, 1, 256)]
KERNEL_OP = {"portable": "tree_attention", "hopper": "tree_attention", "decode": "decode_attention"}
BASELINES = ("null", "xla_ref", "cudnn")


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- candidates
def _dedupe(cands):
    seen, out = set(), []
    for label, cfg in cands:
        if cfg not in seen:
            seen.add(cfg)
            out.append((label, cfg))
    return out


def candidates(kernel, b, t, s, heads, quick_grid):
    """[(label, config)], the heuristic first, at most 8."""
    from pallas_kernels import common
    from pallas_kernels.decode_attention.config import DecodeConfig, decode_config
    from pallas_kernels.tree_attention import config as tcfg

    n, kh, h = heads["n"], heads["kh"], heads["h"]
    g, rows = n // kh, t * (n // kh)
    rep = dataclasses.replace
    if kernel == "hopper":
        heur = tcfg.mosaic_config(rows, h)
        if s % heur.block_k:
            heur = rep(heur, block_k=64)
        nrb = common.cdiv(rows, 64)

        def auto(c):
            ctas = common.ctas_per_sm(tcfg.mosaic_smem_bytes(c, h))
            return common.auto_num_splits(b * kh * nrb, s, c.block_k, ctas=ctas)

        two = tcfg.MosaicConfig(block_k=64, stages=2)
        cands = [("heuristic", heur), ("bk64_st2", two),
                 ("bk64_st3", tcfg.MosaicConfig(block_k=64, stages=3)),
                 ("bk128_st2", tcfg.MosaicConfig(block_k=128, stages=2)),
                 ("bk128_st3", tcfg.MosaicConfig(block_k=128, stages=3)),
                 ("bk64_st2_halfsplits", rep(two, num_splits=max(1, auto(two) // 2))),
                 ("heur_2xsplits", rep(heur, num_splits=min(128, 2 * auto(heur)))),
                 ("heur_pv_smem", rep(heur, pv_via_smem=True))]
        cands = [(lb, c) for lb, c in cands if s % c.block_k == 0]
    elif kernel == "portable":
        heur = tcfg.portable_config(rows, h)
        nrb = common.cdiv(rows, heur.block_q)
        ns = common.auto_num_splits(b * kh * nrb, s, heur.block_k)
        cands = [("heuristic", heur)] + [
            (f"q{bq}_k{bk}_w{w}_st{st}",
             tcfg.PortableConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st))
            for bq, bk, w, st in [(64, 64, 4, 3), (64, 128, 8, 3), (64, 32, 4, 4),
                                  (128, 64, 8, 3), (128, 32, 8, 3), (32, 64, 4, 3)]
        ] + [("heur_2xsplits", rep(heur, num_splits=min(128, 2 * ns)))]
    else:
        heur = decode_config(g, h)
        ns = common.auto_num_splits(b * kh, s, heur.block_k,
                                    min_blocks_per_split=heur.min_blocks_per_split)
        cands = [("heuristic", heur)] + [
            (f"k{bk}_w{w}_st{st}",
             DecodeConfig(block_h=heur.block_h, block_k=bk, num_warps=w, num_stages=st))
            for bk, w, st in [(128, 4, 3), (32, 4, 4), (64, 8, 3), (128, 8, 2), (64, 4, 4)]
        ] + [("heur_2xsplits", rep(heur, num_splits=min(128, 2 * ns))),
             ("heur_halfsplits", rep(heur, num_splits=max(1, ns // 2)))]
    cands = _dedupe(cands)
    return cands[:2] if quick_grid else cands[:8]


def kernel_fn(kernel, cfg, interpret):
    from pallas_kernels.decode_attention import decode_attention
    from pallas_kernels.tree_attention.hopper import cache_attention_hopper
    from pallas_kernels.tree_attention.portable import cache_attention_portable

    if kernel == "decode":
        return lambda q, k, v, p, m, aux: decode_attention(q, k, v, p, impl="splitk",
                                                           config=cfg, interpret=interpret)
    f = cache_attention_hopper if kernel == "hopper" else cache_attention_portable
    return lambda q, k, v, p, m, aux: f(q, k, v, p, m, config=cfg, interpret=interpret)


def baseline_fn(name, t):
    if name == "null":  # the chain's own cost: one elementwise op per call
        return lambda q, k, v, p, m, aux: q
    return ba.build_variants(t)[name][0]


# --------------------------------------------------------------------------- per shape
class Shape:
    def __init__(self, op, b, t, s, heads, seed):
        self.op, self.b, self.t, self.s, self.heads, self.seed = op, b, t, s, heads, seed
        n, kh, h = heads["n"], heads["kh"], heads["h"]
        self.floor_us = b * kh * s * h * 2 * 2 / ba.BANDWIDTH * 1e6  # K and V, bf16, once
        self.flops_us = 4 * b * t * n * s * h / PEAK_FLOPS * 1e6
        self.name = f"{op} B={b} T={t} S={s}"
        self.args = None
        self.want = None

    def prepare(self):
        """Inputs, aux (cuDNN layout, dense mask) and the float32 reference output."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels.tree_attention.reference import cache_attention_reference

        hd = self.heads
        q, k, v, p, m = ba.make_inputs(self.seed, self.b, self.t, hd["n"], hd["kh"], hd["h"],
                                       self.s, [self.s - self.t] * self.b,
                                       "causal" if self.t == 1 else "tree", jnp.bfloat16)
        aux = ba.make_aux(k, v, p, m, self.t)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        with jax.default_matmul_precision("highest"):
            want = jax.jit(cache_attention_reference)(f32(q), f32(k), f32(v), p, m)
        self.want = np.asarray(want)
        self.args = (q, k, v, p, m, aux)
        return self

    def abstract_args(self):
        import jax

        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.args)


def compile_job(shape_future, fn, unroll):
    import jax

    shape = shape_future.result()
    t0 = time.perf_counter()
    compiled = jax.jit(ba.chained(fn, unroll)).lower(*shape.abstract_args()).compile()
    return compiled, time.perf_counter() - t0


def time_compiled(compiled, args, unroll, reps):
    """Microseconds per call of a compiled `ba.chained` program of `unroll` calls."""
    return round(median_seconds(compiled, *args, repeats=reps) / unroll * 1e6, 2)


def check_output(out, want, tol=ba.TOL):
    import numpy as np

    out = np.asarray(out.astype("float32"))
    if out.shape != want.shape:
        return False, f"shape {out.shape} != {want.shape}"
    if not np.isfinite(out).all():
        return False, f"{int((~np.isfinite(out)).sum())} non-finite"
    err = np.abs(out - want)
    ok = bool(np.all(err <= tol + tol * np.abs(want)))
    return ok, f"max_abs_err={float(err.max()):.3g}"


# --------------------------------------------------------------------------- report
def best_per_kernel(shape_rec):
    """kernel -> (best candidate record, heuristic record) among the correct, timed ones."""
    out = {}
    for kernel in ("portable", "hopper", "decode"):
        cands = [c for c in shape_rec["candidates"] if c["kernel"] == kernel and c.get("us")]
        if cands:
            heur = next((c for c in cands if c["label"] == "heuristic"), None)
            out[kernel] = (min(cands, key=lambda c: c["us"]), heur)
    return out


def tuned_tables(results):
    """op -> entries for `common.tuned_config`: winners > 3% faster than the heuristic."""
    tables = {}
    for rec in results["shapes"]:
        for kernel, (best, heur) in best_per_kernel(rec).items():
            if best["label"] == "heuristic" or (heur and best["us"] > 0.97 * heur["us"]):
                continue
            tables.setdefault(KERNEL_OP[kernel], []).append(dict(
                kernel=kernel, batch=rec["B"], T=rec["T"], G=rec["G"], H=rec["H"], S=rec["S"],
                dtype="bfloat16", config=best["config"], us=best["us"],
                heuristic_us=heur["us"] if heur else None))
    return tables


def write_tables(results, tables_dir):
    from pallas_kernels import common

    tag = common.device_tag() or "cpu"
    written = []
    for op, entries in tuned_tables(results).items():
        path = Path(tables_dir) / op / f"tuned_{tag}.json"
        write_json(path, dict(device=results["device"], jax=results["jax"],
                              source="bench/tune_attention.py", entries=entries))
        written.append(str(path))
    return written


def _cell(c, floor_us):
    if not c or not c.get("us"):
        return "-"
    return f"{c['us']:.1f} (x{c['us'] / floor_us:.1f})"


def print_table(results):
    log("\n## Attention config sweep: us per call (x K/V floor at 4.25 TB/s); "
        "kernel cells: best [heuristic]")
    log("| op | B | T | S | floor | compute | null | XLA | cuDNN | portable | hopper | decode "
        "| best config |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rec in results["shapes"]:
        fl = rec["floor_us"]
        base = {c["label"]: c for c in rec["candidates"] if c["kernel"] == "baseline"}
        bests = best_per_kernel(rec)
        cells = []
        for kernel in ("portable", "hopper", "decode"):
            if kernel not in bests:
                cells.append("-")
                continue
            best, heur = bests[kernel]
            cells.append(f"**{best['us']:.1f}** (x{best['us'] / fl:.1f}) "
                         f"[{heur['us']:.1f}]" if heur else f"{best['us']:.1f}")
        winner = min((b for b, _ in bests.values()), key=lambda c: c["us"], default=None)
        cfg = f"{winner['kernel']} {winner['label']}" if winner else "-"
        log(f"| {rec['op']} | {rec['B']} | {rec['T']} | {rec['S']} | {fl:.1f} | "
            f"{rec['compute_us']:.1f} | {_cell(base.get('null'), fl)} | "
            f"{_cell(base.get('xla_ref'), fl)} | {_cell(base.get('cudnn'), fl)} | "
            + " | ".join(cells) + f" | {cfg} |")
    bad = [(r["name"], c) for r in results["shapes"] for c in r["candidates"] if c.get("error")
           or c.get("ok") is False]
    for name, c in bad:
        log(f"- {name} {c['kernel']} {c['label']}: "
            + (c.get("error") or c.get("check", "wrong output"))[:200])
    if results.get("hung"):
        log(f"- HUNG: {results['hung']}")


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON with every candidate")
    ap.add_argument("--tables-dir", default=None,
                    help="where tuned_<gpu>.json tables go (default: <dir of --out>/tuned)")
    ap.add_argument("--budget-s", type=float, default=270.0)
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="compile threads")
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kernels", default="portable,hopper,decode")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--quick", action="store_true", help="6 shapes (GPU); 2 configs per kernel "
                    "with --interpret")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU: kernels in interpret mode on tiny shapes (tests this script)")
    args = ap.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget_s
    reserve = min(30.0, 0.12 * args.budget_s)  # the quiet re-timing pass and the report
    out_path = args.out
    tables_dir = args.tables_dir or (str(Path(out_path).parent / "tuned") if out_path else None)

    import jax

    heads, shapes = HEADS, (QUICK_SHAPES if args.quick else SHAPES)
    unroll, reps = args.unroll, args.reps
    if args.interpret:
        heads, shapes, unroll, reps = TINY_HEADS, TINY_SHAPES, 2, 2
        ba.INTERPRET = True
    kernels = [k for k in args.kernels.split(",") if k]
    dev = jax.devices()[0]
    results = dict(device=str(getattr(dev, "device_kind", dev)), jax=jax.__version__,
                   heads=heads, bandwidth=ba.BANDWIDTH, args=vars(args), shapes=[], errors=[])
    log(f"device: {results['device']} jax {jax.__version__}; {len(shapes)} shapes, "
        f"budget {args.budget_s:.0f}s, {args.workers} compile workers")

    def save():
        results["elapsed_s"] = round(time.perf_counter() - start, 1)
        if out_path:
            write_json(out_path, results)

    ba.start_watchdog(results, save, args.hang_s, report=print_table)
    pool = cf.ThreadPoolExecutor(max_workers=max(1, args.workers))

    # Submit everything in priority order: per shape its inputs, baselines, then kernels
    # (Mosaic last: a hang there loses least).
    plan = []
    for i, (op, b, t, s) in enumerate(shapes):
        shape = Shape(op, b, t, s, heads, seed=7 + i)
        fut = pool.submit(shape.prepare)
        rec = dict(name=shape.name, op=op, B=b, T=t, S=s, G=heads["n"] // heads["kh"],
                   H=heads["h"], floor_us=round(shape.floor_us, 2),
                   compute_us=round(shape.flops_us, 2), candidates=[])
        jobs = [] if args.no_baselines else [
            ("baseline", name, None, baseline_fn(name, t)) for name in BASELINES]
        ks = ["decode"] if op == "decode" else ["portable", "hopper"]
        for kernel in [k for k in ks if k in kernels]:
            for label, cfg in candidates(kernel, b, t, s, heads, args.interpret and args.quick):
                jobs.append((kernel, label, cfg, kernel_fn(kernel, cfg, args.interpret)))
        jobs = [(kernel, label, cfg, pool.submit(compile_job, fut, fn, unroll))
                for kernel, label, cfg, fn in jobs]
        plan.append((shape, fut, rec, jobs))

    timed = []  # (shape, candidate record, compiled) for the quiet pass
    try:
        for shape, fut, rec, jobs in plan:
            if time.perf_counter() > deadline - reserve:
                break
            results["shapes"].append(rec)
            try:  # queued behind the compiles of earlier shapes: not a hang
                fut.result(timeout=max(1.0, deadline - reserve - time.perf_counter()))
            except cf.TimeoutError:
                rec["skipped"] = "time budget (inputs not ready)"
                break
            for kernel, label, cfg, job in jobs:
                left = deadline - reserve - time.perf_counter()
                c = dict(kernel=kernel, label=label,
                         config=dataclasses.asdict(cfg) if cfg is not None else None)
                rec["candidates"].append(c)
                if left <= 0:
                    c["skipped"] = "time budget"
                    continue
                ba.PROGRESS["since"] = None  # waiting on a compile is not a GPU hang
                try:
                    compiled, c["compile_s"] = job.result(timeout=min(left, args.hang_s))
                    c["compile_s"] = round(c["compile_s"], 2)
                    ba.progress(f"{shape.name} {kernel} {label}")
                    _, out = compiled(*shape.args)
                    ok = True
                    if label != "null":  # (its output is q)
                        ok, c["check"] = check_output(out, shape.want)
                        c["ok"] = ok
                    if ok:
                        c["us_busy"] = c["us"] = time_compiled(compiled, shape.args, unroll, reps)
                        timed.append((shape, c, compiled))
                except cf.TimeoutError:
                    c["error"] = f"compile did not finish within {min(left, args.hang_s):.0f}s"
                except NotImplementedError as e:
                    c["error"] = f"unsupported: {str(e)[:200]}"
                except Exception as e:  # noqa: BLE001
                    c["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                ba.PROGRESS["since"] = None
                log(f"{shape.name:24s} {kernel:8s} {label:20s} "
                    + (f"{c['us']:9.1f} us (x{c['us'] / shape.floor_us:.2f})" if c.get("us")
                       else c.get("error", c.get("check", "")))[:160])
            save()
        # Quiet pass: no new compiles; re-time every correct candidate.
        pool.shutdown(wait=False, cancel_futures=True)
        for shape, c, compiled in timed:
            if time.perf_counter() > deadline:
                break
            ba.progress(f"quiet {shape.name} {c['kernel']} {c['label']}")
            c["us"] = time_compiled(compiled, shape.args, unroll, reps)
            c["quiet"] = True
    except Exception as e:  # noqa: BLE001
        results["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        log(results["errors"][-1])
    ba.PROGRESS["since"] = None
    if tables_dir:
        results["tables"] = write_tables(results, tables_dir)
    save()
    print_table(results)
    log(f"\nelapsed {time.perf_counter() - start:.0f}s"
        + (f"; wrote {out_path}" if out_path else "")
        + (f"; tuned tables: {', '.join(results['tables'])}" if results.get("tables") else ""))
    os._exit(0)  # compile threads still running must not hold the process


if __name__ == "__main__":
    main()
