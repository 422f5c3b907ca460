"""Cache / tree attention kernels on one GPU: correctness first, then speed against the XLA
reference, cuDNN (jax.nn.dot_product_attention), tokamax (if importable) and the
memory-bandwidth floor (K/V bytes visible to the queries, read once, at 4.25e12 B/s).

Stage 1 (check): every kernel variant on fresh random bf16 inputs (Qwen3-8B heads and a
head-dim-64 case; ragged prefix lengths; T = 1, 16, 37, 200, 256; tree / causal / all-ones
masks), with the device allocator pre-filled with NaN before each call (so an output element
a kernel forgets to write shows up) and the never-visible cache slots >= prefix_len + T set
to NaN for the kernels that promise not to read them; compared against the XLA reference run
in float32 (highest matmul precision) on the same bf16 values.
Stage 2 (verify attention): N=32, K=8, H=128, batch 1, T in {16, 64, 128, 256} (random tree
masks), S in {512, 2048, 8192, 32768}, prefix_len = S - T (the whole cache visible).
Stage 3 (decode attention): T=1, batch 1 and 8, S in {512, 2048, 8192, 32768}, prefix S - 1.

Times: `call_us` = median over --iters calls of a jitted call + block_until_ready (includes
host dispatch, ~10-30 us); `gpu_us` = per-call time of --unroll calls chained inside one jit
(amortizes dispatch; every call is chained, however long). `floor_us` = visible K/V bytes /
4.25e12. Failures of any variant are recorded, never fatal; a time budget (--budget-s) skips
the remaining timings but still writes the JSON.

Run on the GPU machine (no network needed):
  python -m bench.bench_attention            # full: ~5-7 min on an H200
  python -m bench.bench_attention --quick    # fewer shapes, ~2 min
  python -m bench.bench_attention --check-only
Writes the results as JSON to --out PATH.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import traceback


from bench.common.results_io import write_json
from bench.common.timing import median_seconds

BANDWIDTH = 4.25e12  # B/s, measured on the H200 this runs on
N_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B attention
VERIFY_T = (16, 64, 128, 256)
VERIFY_S = (512, 2048, 8192, 32768)
DECODE_S = (512, 2048, 8192, 32768)
DECODE_B = (1, 8)
TOL = 3e-2
INTERPRET = False  # --dry-run: kernels in interpret mode on CPU, tiny shapes (tests the script)


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- inputs
def random_tree_mask(rng, batch, t):
    import numpy as np

    masks = []
    for _ in range(batch):
        parents = [-1] + [int(rng.integers(0, n)) for n in range(1, t)]
        m = np.eye(t, dtype=bool)
        for n in range(1, t):
            m[n] |= m[parents[n]]
        masks.append(m)
    return np.stack(masks)


def make_inputs(seed, batch, t, n, kh, h, s, prefix, mask_kind, dtype):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, t, n, h), dtype)
    k = jax.random.normal(ks[1], (batch, kh, s, h), dtype)
    v = jax.random.normal(ks[2], (batch, kh, s, h), dtype)
    prefix = jnp.asarray(prefix, jnp.int32)
    if mask_kind == "causal":
        mask = None
    elif mask_kind == "ones":
        mask = jnp.ones((batch, t, t), bool)
    else:
        mask = jnp.asarray(random_tree_mask(rng, batch, t))
    return q, k, v, prefix, mask


def poison_beyond(cache, prefix, t, value):
    import jax.numpy as jnp

    slots = jnp.arange(cache.shape[2])[None, None, :, None]
    return jnp.where(slots >= (prefix + t)[:, None, None, None], jnp.asarray(value, cache.dtype),
                     cache)


def poison_allocator(shapes_dtypes, extra_bytes=256 << 20):
    """Fill freed device memory with NaN: allocate NaN buffers (output-sized ones and a large
    one), wait, free them; the allocator then hands that memory to the next outputs."""
    import jax.numpy as jnp

    bufs = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in shapes_dtypes]
    bufs.append(jnp.full((extra_bytes // 4,), jnp.nan, jnp.float32))
    for b in bufs:
        b.block_until_ready()
    for b in bufs:
        b.delete()


# --------------------------------------------------------------------------- variants
def build_variants(t):
    """name -> (fn(q, k, v, prefix, mask, aux) -> out, never_reads_beyond). aux holds
    pre-computed inputs for third-party APIs (BSKH cache, dense mask, lengths)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.decode_attention import decode_attention
    from pallas_kernels.tree_attention import cache_attention
    from pallas_kernels.tree_attention.config import MosaicConfig
    from pallas_kernels.tree_attention.hopper import cache_attention_hopper
    from pallas_kernels.tree_attention.portable import cache_attention_portable
    from pallas_kernels.tree_attention.reference import cache_attention_reference

    v = {}
    v["xla_ref"] = (lambda q, k, vv, p, m, aux: cache_attention_reference(q, k, vv, p, m), False)
    ip = INTERPRET
    v["portable"] = (lambda q, k, vv, p, m, aux: cache_attention_portable(
        q, k, vv, p, m, interpret=ip), True)
    v["hopper"] = (lambda q, k, vv, p, m, aux: cache_attention_hopper(
        q, k, vv, p, m, interpret=ip), False)
    v["hopper_smemP"] = (
        lambda q, k, vv, p, m, aux: cache_attention_hopper(
            q, k, vv, p, m, config=MosaicConfig(block_k=64, stages=4, pv_via_smem=True),
            interpret=ip), False)
    if t == 1:
        v["decode"] = (lambda q, k, vv, p, m, aux: decode_attention(
            q, k, vv, p, impl="splitk", interpret=ip), True)
    v["auto"] = (lambda q, k, vv, p, m, aux: cache_attention(q, k, vv, p, m, interpret=ip),
                 False)  # the default list

    def cudnn(q, k, vv, p, m, aux):
        if t == 1:  # padding mask from lengths: no dense mask needed
            return jax.nn.dot_product_attention(q, aux["k_bskh"], aux["v_bskh"],
                                                key_value_seq_lengths=p + 1,
                                                implementation="cudnn")
        return jax.nn.dot_product_attention(q, aux["k_bskh"], aux["v_bskh"], mask=aux["dense"],
                                            implementation="cudnn")

    v["cudnn"] = (cudnn, False)
    try:
        import tokamax  # noqa: F401

        def tk(impl):
            def fn(q, k, vv, p, m, aux):
                if t == 1:
                    return tokamax.dot_product_attention(
                        q, aux["k_bskh"], aux["v_bskh"], key_value_seq_lengths=p + 1,
                        implementation=impl)
                return tokamax.dot_product_attention(q, aux["k_bskh"], aux["v_bskh"],
                                                     mask=aux["dense"], implementation=impl)
            return fn

        v["tokamax"] = (tk(None), False)
        v["tokamax_mosaic"] = (tk("mosaic"), False)
    except Exception:  # not installed
        pass
    del jnp
    order = ["xla_ref", "portable", "decode", "cudnn", "tokamax", "tokamax_mosaic", "hopper",
             "hopper_smemP", "auto"]  # own Mosaic kernels last: a GPU hang loses least
    return {name: v[name] for name in order if name in v}


def make_aux(k, v, prefix, mask, t):
    import jax.numpy as jnp

    from pallas_kernels.tree_attention.reference import visibility

    s = k.shape[2]
    dense = visibility(prefix, mask, t, s)[:, None]  # [B, 1, T, S]
    return {
        "k_bskh": jnp.transpose(k, (0, 2, 1, 3)),
        "v_bskh": jnp.transpose(v, (0, 2, 1, 3)),
        "dense": dense,
    }


# --------------------------------------------------------------------------- timing
def chained(fn, unroll):
    """unroll calls of fn inside one jit, each depending on the previous one (so none is
    hoisted or overlapped), returning a scalar and the last call's output (which equals
    fn's own output unless an earlier one was non-finite)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def run(q, *rest):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(unroll):
            qi = q + (acc * 0).astype(q.dtype)
            out = lax.optimization_barrier(fn(qi, *rest))
            acc = acc + out[0, 0, 0, 0].astype(jnp.float32)
        return acc, out

    return jax.jit(run)


def bench_one(name, fn, q, k, v, prefix, mask, aux, iters, unroll):
    import jax

    jfn = jax.jit(lambda q_, k_, v_, p_, m_, a_: fn(q_, k_, v_, p_, m_, a_))
    args = (q, k, v, prefix, mask, aux)
    t0 = time.perf_counter()
    jax.block_until_ready(jfn(*args))
    compile_s = time.perf_counter() - t0
    call_us = median_seconds(jfn, *args, repeats=iters, warmup=3) * 1e6
    # Always chained: a per-call time carries the host's dispatch and sync, which made long
    # calls look up to ~2x slower than chained ones.
    cfn = chained(lambda q_, k_, v_, p_, m_, a_: fn(q_, k_, v_, p_, m_, a_), unroll)
    gpu_us = median_seconds(cfn, *args, repeats=max(3, iters // 4)) / unroll * 1e6
    return dict(call_us=round(call_us, 2), gpu_us=round(gpu_us, 2), compile_s=round(compile_s, 2))


# --------------------------------------------------------------------------- stages
CHECK_CASES = [
    # (name, batch, T, N, K, H, S, prefix per batch, mask)
    ("verify_tree_T16", 2, 16, 32, 8, 128, 1024, (0, 700), "tree"),
    ("verify_tree_T37_ragged", 2, 37, 32, 8, 128, 1024, (100, 987), "tree"),
    ("verify_tree_T256", 1, 256, 32, 8, 128, 4096, (3000,), "tree"),
    ("draft_block_T16_causal", 2, 16, 32, 8, 128, 2048, (5, 1900), "causal"),
    ("draft_block_T16_ones", 2, 16, 32, 8, 128, 2048, (64, 1000), "ones"),
    ("prefill_T200_causal", 1, 200, 32, 8, 128, 256, (0,), "causal"),
    ("decode_T1_ragged", 3, 1, 32, 8, 128, 4096, (0, 513, 4095), "causal"),
    ("h64_G3_tree_T64", 2, 64, 12, 4, 64, 512, (17, 448), "tree"),
]


PROGRESS = {"what": None, "since": None}


def progress(what):
    PROGRESS["what"], PROGRESS["since"] = what, time.perf_counter()


def start_watchdog(results, save, hang_s, report=None):
    """If one variant runs for more than hang_s (a kernel hang), record it, write the JSON and
    the table (`report(results)`, default `print_table`), and exit, so the results so far are
    not lost to the outer time limit."""
    import threading

    def watch():
        while True:
            time.sleep(5)
            since = PROGRESS["since"]
            if since is not None and time.perf_counter() - since > hang_s:
                results["hung"] = f"{PROGRESS['what']} ran > {hang_s:.0f}s; aborted"
                log(f"\nWATCHDOG: {results['hung']}")
                try:
                    save()
                    (report or print_table)(results)
                finally:
                    os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def run_check(results, save, deadline, skip=()):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.tree_attention.reference import cache_attention_reference

    for ci, (cname, b, t, n, kh, h, s, prefix, mk) in enumerate(CHECK_CASES):
        if time.perf_counter() > deadline:
            results["check"].append(dict(case=cname, skipped="time budget"))
            continue
        q, k, v, p, m = make_inputs(1000 + ci, b, t, n, kh, h, s, prefix, mk, jnp.bfloat16)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        with jax.default_matmul_precision("highest"):
            want = np.asarray(jax.jit(cache_attention_reference)(f32(q), f32(k), f32(v), p, m))
        aux = make_aux(k, v, p, m, t)
        k_nan, v_nan = poison_beyond(k, p, t, jnp.nan), poison_beyond(v, p, t, jnp.nan)
        k_fin, v_fin = poison_beyond(k, p, t, 3e4), poison_beyond(v, p, t, -3e4)
        aux_fin = make_aux(k_fin, v_fin, p, m, t)
        for vname, (fn, strict) in build_variants(t).items():
            if vname in skip:
                continue
            progress(f"check {cname} {vname}")
            rec = dict(case=cname, variant=vname, poison="nan" if strict else "finite")
            try:
                kk, vv, ax = (k_nan, v_nan, aux) if strict else (k_fin, v_fin, aux_fin)
                poison_allocator([(q.shape, q.dtype)])
                out = jax.jit(fn)(q, kk, vv, p, m, ax)
                out = np.asarray(out.astype(jnp.float32))
                err = np.abs(out - want)
                rec["max_abs_err"] = float(np.nanmax(err)) if np.isfinite(out).any() else None
                rec["nonfinite"] = int((~np.isfinite(out)).sum())
                rec["ok"] = bool(rec["nonfinite"] == 0
                                 and np.all(err <= TOL + TOL * np.abs(want)))
            except NotImplementedError as e:  # shape not served: not a failure
                rec["unsupported"] = str(e)[:300]
            except Exception as e:  # noqa: BLE001
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            results["check"].append(rec)
            log(f"check {cname:26s} {vname:15s} "
                + ("OK " if rec.get("ok") else ("n/a " if "unsupported" in rec else "FAIL"))
                + (f" err={rec.get('max_abs_err')}" if "max_abs_err" in rec else "")
                + (f" nonfinite={rec.get('nonfinite')}" if rec.get("nonfinite") else "")
                + (f" {rec.get('error', '')[:160]}" if "error" in rec else ""))
        save()


def run_timing(stage, shapes, results, save, deadline, iters, unroll, skip_variants):
    import jax
    import jax.numpy as jnp

    bad_variants = {r["variant"] for r in results["check"]
                    if r.get("ok") is False and "variant" in r}
    if "hopper" in bad_variants and "hopper_smemP" not in bad_variants:
        skip_variants = skip_variants - {"hopper_smemP"}  # time the variant that works
    for (b, t, s) in shapes:
        prefix = [s - t] * b
        q, k, v, p, m = make_inputs(7, b, t, N_HEADS, KV_HEADS, HEAD_DIM, s, prefix,
                                    "causal" if t == 1 else "tree", jnp.bfloat16)
        aux = make_aux(k, v, p, m, t)
        floor_us = b * KV_HEADS * s * HEAD_DIM * 2 * 2 / BANDWIDTH * 1e6  # K and V, bf16
        row = dict(stage=stage, batch=b, T=t, S=s, floor_us=round(floor_us, 2), variants={})
        for vname, (fn, _) in build_variants(t).items():
            if vname in skip_variants:
                continue
            if time.perf_counter() > deadline:
                row["variants"][vname] = dict(skipped="time budget")
                continue
            progress(f"{stage} B={b} T={t} S={s} {vname}")
            try:
                rec = bench_one(vname, fn, q, k, v, p, m, aux, iters, unroll)
                rec["x_floor"] = round(rec["gpu_us"] / floor_us, 2)
                if vname in bad_variants:
                    rec["check_failed"] = True
            except Exception as e:  # noqa: BLE001
                rec = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            row["variants"][vname] = rec
            log(f"{stage} B={b} T={t} S={s} {vname:15s} " + (
                f"gpu={rec['gpu_us']:9.1f}us call={rec['call_us']:9.1f}us "
                f"floor={floor_us:7.1f}us x{rec['x_floor']}" if "gpu_us" in rec
                else str(rec)[:200]))
        results[stage].append(row)
        save()


def print_table(results):
    for stage in ("verify", "decode"):
        rows = results.get(stage) or []
        if not rows:
            continue
        names = []
        for r in rows:
            for n in r["variants"]:
                if n not in names:
                    names.append(n)
        log(f"\n== {stage}: GPU time per call in us (x floor); floor = visible K/V bytes / 4.25e12 B/s")
        head = f"{'B':>2} {'T':>4} {'S':>6} {'floor':>7} | " + " | ".join(f"{n[:14]:>16}" for n in names)
        log(head)
        log("-" * len(head))
        for r in rows:
            cells = []
            for n in names:
                rec = r["variants"].get(n)
                if rec is None:
                    cells.append(f"{'-':>16}")
                elif "gpu_us" in rec:
                    mark = "!" if rec.get("check_failed") else ""
                    xf = rec["x_floor"]
                    xs = f"x{xf:.1f}" if xf < 100 else f"x{xf:.0f}"
                    cells.append(f"{rec['gpu_us']:.1f} {xs}{mark}".rjust(16))
                elif "skipped" in rec:
                    cells.append(f"{'skip':>16}")
                else:
                    cells.append(f"{'ERR':>16}")
            log(f"{r['batch']:>2} {r['T']:>4} {r['S']:>6} {r['floor_us']:7.1f} | " + " | ".join(cells))
    bad = [r for r in results.get("check", []) if r.get("ok") is False]
    log(f"\ncheck: {sum(1 for r in results.get('check', []) if r.get('ok'))} ok, {len(bad)} failed")
    for r in bad:
        log(f"  FAIL {r['case']} {r['variant']}: "
            + (r.get("error") or f"max_abs_err={r.get('max_abs_err')} nonfinite={r.get('nonfinite')}")[:300])
    log("('!' = variant failed a correctness check; ERR = did not run, see JSON)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop starting new timings after this many seconds")
    ap.add_argument("--skip", default="", help="comma-separated variants to skip (check and timing)")
    ap.add_argument("--hang-s", type=float, default=150.0,
                    help="watchdog: abort (writing results) if one variant runs longer")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: kernels in interpret mode on tiny shapes (tests this script)")
    args = ap.parse_args()
    if args.dry_run:
        global INTERPRET, N_HEADS, KV_HEADS, HEAD_DIM, CHECK_CASES
        INTERPRET = True
        N_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
        CHECK_CASES = [("dry_tree_T5", 2, 5, 8, 2, 64, 128, (0, 100), "tree"),
                       ("dry_decode", 2, 1, 8, 2, 64, 128, (0, 127), "causal")]

    start = time.perf_counter()
    deadline = start + args.budget_s
    out_path = args.out

    import jax

    dev = jax.devices()[0]
    results = dict(
        device=str(getattr(dev, "device_kind", dev)),
        compute_capability=str(getattr(dev, "compute_capability", None)),
        jax=jax.__version__, python=platform.python_version(), bandwidth=BANDWIDTH,
        args=vars(args), check=[], verify=[], decode=[], errors=[])
    log(f"device: {results['device']} cc={results['compute_capability']} jax {jax.__version__}")

    def save():
        results["elapsed_s"] = round(time.perf_counter() - start, 1)
        if out_path:
            try:
                write_json(out_path, results)
            except Exception as e:  # noqa: BLE001
                log(f"could not write {out_path}: {e}")

    user_skip = {x for x in args.skip.split(",") if x}
    start_watchdog(results, save, args.hang_s)
    try:
        if not args.no_check:
            run_check(results, save, deadline, user_skip)
        if not args.check_only:
            vt, vs = (VERIFY_T, VERIFY_S) if not args.quick else ((16, 256), (2048, 32768))
            ds = DECODE_S if not args.quick else (2048, 32768)
            if args.dry_run:
                vt, vs, ds = (16,), (128,), (128,)
            skip = user_skip | {"hopper_smemP", "auto"}
            run_timing("verify", [(1, t, s) for t in vt for s in vs], results, save, deadline,
                       args.iters, args.unroll, skip)
            db = DECODE_B if not args.dry_run else (1,)
            run_timing("decode", [(b, 1, s) for b in db for s in ds], results, save,
                       deadline, args.iters, args.unroll, skip)
    except Exception as e:  # noqa: BLE001
        results["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        log(results["errors"][-1])
    progress(None)
    PROGRESS["since"] = None
    save()
    print_table(results)
    log(f"\nelapsed {time.perf_counter() - start:.0f}s" + (f"; wrote {out_path}" if out_path else ""))


if __name__ == "__main__":
    main()
