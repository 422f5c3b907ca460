"""The fused decode-layer projections (`pallas_kernels.gemv.fused`) against what XLA makes of
the same unfused math, per projection group of a Qwen3-8B layer and in whole decode steps,
in one process.

  python3 bench/bench_fused_gemv.py --out $OUT/fused_gemv.json                # H200, ~4 min
  JAX_PLATFORMS=cpu python3 bench/bench_fused_gemv.py --quick --out /tmp/f.json  # CPU check

(a) correctness: each group's kernel output (default config, fresh random bf16 operands, M=1
    and 4) against a float32 reference of the unfused math: max |error| / max |reference|.
(b) per group (attention norm + q/k/v; o + residual; MLP norm + gate/up + SwiGLU; down +
    residual) and M: a stack of one weight set per layer (36, as the model, beyond the 50 MB
    L2) run layer after layer, `reps` times, in one jitted fori_loop; time per group = (t(reps)
    - t(1)) / ((reps - 1) * layers) (medians of --repeats calls). "xla" is
    `fused_gemv_reference` (rms_norm, the dots, SiLU x up, the residual add) as XLA compiles
    it; then a sweep of kernel configs, the heuristic default first. TB/s over weight bytes.
(c) whole decode steps (random bf16 weights, ctx --context, batch 1;
    `bench_gemv_pallas.bench_decode_steps`): Qwen3-8B with matmul_impl "xla" and "fused",
    Qwen3-30B-A3B with "pallas" and "fused".
Percentages are of PEAK_TBPS (../shared/gpu.md). Tables (markdown) are printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv_pallas import (PEAK_TBPS, add_timing_options, bench_decode_steps,  # noqa: E402
                               record)
from results_io import command_line, write_json  # noqa: E402
from timing import loop_seconds  # noqa: E402

# name -> (K, output widths, norm, residual, swiglu): the groups of a Qwen3-8B layer. swiglu
# True: gate and up read by one program, SiLU x up in the kernel; "after": gate and up as two
# outputs (one weight a program, as q/k/v), SiLU x up in XLA (the split-K epilogue's fusion).
GROUPS = {
    "norm+qkv": (4096, (4096, 1024, 1024), True, False, False),
    "o+res": (4096, (4096,), False, True, False),
    "norm+gate/up+swiglu": (4096, (12288, 12288), True, False, True),
    "norm+gate,up (swiglu after)": (4096, (12288, 12288), True, False, "after"),
    "down+res": (12288, (4096,), False, True, False),
}
QUICK_GROUPS = {"norm+qkv": (128, (64, 32, 32), True, False, False),
                "down+res": (192, (64,), False, True, False)}
DECODE = {"qwen3-8b": ("xla", "fused"), "qwen3-30b-a3b": ("pallas", "fused")}
QUICK_DECODE = {"tiny-dense": ("xla", "fused"), "tiny-moe": ("pallas", "fused")}
ERR_TOL = 2e-2


def sweep_configs(k, widths, swiglu, limit):
    """The heuristic default first, then tiles of 64 or 128 columns with split-K (what
    streamed best in the first sweep on the H200), and one without."""
    from pallas_kernels.gemv.fused import FusedGemvConfig, _segments, fused_config

    base = fused_config(k, _segments(widths, swiglu, 128)[1])
    cands = [base] + [FusedGemvConfig(bk, bn, num_stages=st, num_splits=sp)
                      for bk, bn, sp, st in ((256, 64, 2, 4), (128, 128, 4, 3), (128, 128, 8, 3),
                                             (256, 64, 2, 3), (128, 64, 2, 4), (256, 128, 2, 3),
                                             (256, 64, 4, 4), (256, 64, 1, 4), (512, 64, 2, 3),
                                             (256, 128, 4, 4), (256, 64, 3, 4))]
    out = []
    for c in cands:
        if c not in out and c.block_k <= max(16, k):
            out.append(c)
    return out[:limit]


def best_table(rows, groups, device):
    """Per group and M, the fastest correct kernel config, as `tuned_fused_config` reads it."""
    from pallas_kernels.gemv.fused import table_key

    entries = []
    for (group, m) in dict.fromkeys((r["group"], r["M"]) for r in rows):
        kern = [r for r in rows if (r["group"], r["M"]) == (group, m)
                and r["impl"] == "pallas" and r.get("us", 0) > 0]
        if not kern:
            continue
        best = min(kern, key=lambda r: r["us"])
        k, widths, norm, residual, swiglu = groups[group]
        entries.append({**table_key(m, k, widths, norm=norm, residual=residual,
                                    swiglu=swiglu is True,
                                    dtype="bfloat16"), "group": group, "config": best["config"],
                        "us": best["us"], "pct_peak": best.get("pct_peak")})
    return {"device": device, "source": "bench/bench_fused_gemv.py", "entries": entries}


def merged_table(path, new):
    """`new` with the entries of the table already at path whose keys it does not replace."""
    try:
        old = json.loads(Path(path).read_text()).get("entries", [])
    except (OSError, ValueError):
        old = []
    from pallas_kernels.gemv.fused import KEY_FIELDS

    key = lambda e: tuple(json.dumps(e.get(f)) for f in KEY_FIELDS)  # noqa: E731
    fresh = {key(e) for e in new["entries"]}
    new["entries"] = [e for e in old if key(e) not in fresh] + new["entries"]
    return new


def chained(fn):
    """jit(layers, x, g, r, reps): `fn(x, weights, g, r)` for each layer's weights, layer after
    layer, reps times; the next x is nudged by the last output so that nothing is hoisted."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(layers, x, g, r, reps):
        def body(_, carry):
            x, acc = carry
            for ws in layers:
                ys = fn(x, ws, g, r)
                y = ys[0].astype(jnp.float32)
                acc = acc + jnp.sum(y) + sum(jnp.sum(z[:, :1].astype(jnp.float32))
                                             for z in ys[1:])
                x = x + (y[:, :1] * 1e-9).astype(x.dtype)
            return x, acc

        return jax.lax.fori_loop(0, reps, body, (x, jnp.zeros((), jnp.float32)))[1]

    return run


def silu_after(swiglu, outs):
    """The model's SiLU x up over the kernel's gate and up outputs for swiglu="after"."""
    import jax

    return (jax.nn.silu(outs[0]) * outs[1],) if swiglu == "after" else outs


def check_group(name, k, widths, norm, residual, swiglu, m, interpret):
    """Max relative error of the default-config kernel against a float32 reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.gemv.fused import fused_gemv_pallas, fused_gemv_reference

    keys = jax.random.split(jax.random.key(len(name) * 100 + m), len(widths) + 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    ws = [(jax.random.normal(kk, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
          for kk, n in zip(keys[3:], widths)]
    g = (1 + 0.1 * jax.random.normal(keys[1], (k,))).astype(jnp.bfloat16) if norm else None
    r = jax.random.normal(keys[2], (m, widths[0]), jnp.bfloat16) if residual else None
    swiglu = swiglu is True  # "after": the kernel's two outputs are checked
    got = fused_gemv_pallas(x, ws, g, r, swiglu=swiglu, interpret=interpret)
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        want = fused_gemv_reference(f32(x), [f32(w) for w in ws], f32(g), f32(r),
                                    swiglu=swiglu)
    return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b)))
                     / np.max(np.abs(np.asarray(b)))) for a, b in zip(got, want))


def bench_group(name, spec, ms, args, deadline, rows):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemv.fused import fused_gemv_pallas, fused_gemv_reference

    k, widths, norm, residual, swiglu = spec
    weight_bytes = k * sum(widths) * 2
    keys = jax.random.split(jax.random.key(k + sum(widths)), args.layers * len(widths) + 3)
    layers = [tuple((0.02 * jax.random.normal(keys[i * len(widths) + j], (k, n))
                     ).astype(jnp.bfloat16) for j, n in enumerate(widths))
              for i in range(args.layers)]
    g = jnp.ones((k,), jnp.bfloat16) if norm else None
    for m in ms:
        x = jax.random.normal(keys[-1], (m, k), jnp.bfloat16)
        r = jax.random.normal(keys[-2], (m, widths[0]), jnp.bfloat16) if residual else None
        variants = [("xla", None)] + [("pallas", c) for c in
                                      sweep_configs(k, widths, swiglu is True, args.sweep)]
        for i, (impl, cfg) in enumerate(variants):
            if time.perf_counter() > deadline:
                print(f"budget spent: skipping {name} M={m} from variant {i}", flush=True)
                break
            row = {"group": name, "K": k, "widths": list(widths), "M": m, "impl": impl,
                   "config": dataclasses.asdict(cfg) if cfg else None, "default": i == 1,
                   "layers": args.layers}
            if impl == "xla":
                fn = lambda x, ws, g, r: fused_gemv_reference(  # noqa: E731
                    x, ws, g, r, swiglu=bool(swiglu))
            else:
                fn = lambda x, ws, g, r, cfg=cfg: silu_after(swiglu, fused_gemv_pallas(  # noqa
                    x, ws, g, r, swiglu=swiglu is True, config=cfg, interpret=args.interpret))

            def measure(fn=fn):
                per, compile_s, _ = loop_seconds(chained(fn), layers, x, g, r, reps=args.reps,
                                                 repeats=args.repeats)
                sec = per / args.layers
                out = dict(compile_s=compile_s, us=sec * 1e6)
                if sec > 0:
                    out.update(TBps=weight_bytes / sec / 1e12,
                               pct_peak=100 * weight_bytes / sec / 1e12 / PEAK_TBPS)
                return out

            record(rows, row, measure)
    del layers
    jax.clear_caches()


def report(result):
    lines = [f"device {result['device']}, {result['date']}", "",
             "| group | M | check (max rel err) |", "|---|---|---|"]
    lines += [f"| {c['group']} | {c['M']} | {c.get('rel_err', c.get('error'))} |"
              for c in result["checks"]]
    lines += ["", "| group | M | XLA us (% of peak) | default us (%) | best us (%) | best config |",
              "|---|---|---|---|---|---|"]
    for (group, m) in dict.fromkeys((r["group"], r["M"]) for r in result["rows"]):
        rs = [r for r in result["rows"] if (r["group"], r["M"]) == (group, m) and "us" in r]
        xla = next((r for r in rs if r["impl"] == "xla"), None)
        default = next((r for r in rs if r["default"]), None)
        kern = [r for r in rs if r["impl"] == "pallas" and r["us"] > 0]
        best = min(kern, key=lambda r: r["us"]) if kern else None
        cell = lambda r: f"{r['us']:.1f} ({r.get('pct_peak', 0):.0f}%)" if r else "-"  # noqa
        cfg = best["config"] if best else {}
        lines.append(f"| {group} | {m} | {cell(xla)} | {cell(default)} | {cell(best)} | "
                     f"{cfg.get('block_k')}x{cfg.get('block_n')} s{cfg.get('num_splits')} "
                     f"st{cfg.get('num_stages')} w{cfg.get('num_warps')} |")
    lines += ["", "| model | matmul_impl | ms/token | weight TB/s | % of peak | compile s |",
              "|---|---|---|---|---|---|"]
    for r in result["decode"]:
        if "ms_per_token" in r:
            lines.append(f"| {r['model']} | {r['matmul_impl']} | {r['ms_per_token']:.3f} | "
                         f"{r['weight_TBps']:.2f} | {100 * r['weight_TBps'] / PEAK_TBPS:.1f}% | "
                         f"{r['compile_s']:.1f} |")
        else:
            lines.append(f"| {r['model']} | {r['matmul_impl']} | error: {r['error'][:80]} |")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--ms", type=int, nargs="+", default=[1])
    parser.add_argument("--sweep", type=int, default=12, help="kernel configs per group and M")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--budget-s", type=float, default=150, help="for the group sweep")
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    add_timing_options(parser, DECODE)
    parser.add_argument("--write-table", default=None,
                        help="write the best config per group here before the decode steps "
                             "(pallas_kernels/gemv/tuned_fused_<gpu>.json: the steps use it)")
    args = parser.parse_args()

    import jax

    from pallas_kernels import common

    args.interpret = jax.default_backend() != "gpu"
    groups = {g: GROUPS[g] for g in args.groups}
    decode_models = {m: DECODE[m] for m in args.decode_models}
    if args.quick:
        groups, decode_models = QUICK_GROUPS, QUICK_DECODE
        args.sweep, args.layers, args.reps, args.repeats, args.context = 2, 2, 3, 2, 16
    start = time.perf_counter()
    checks = []
    for name, (k, widths, norm, residual, swiglu) in groups.items():
        for m in (1, 4):
            try:
                err = check_group(name, k, widths, norm, residual, swiglu, m, args.interpret)
                checks.append({"group": name, "M": m, "rel_err": err, "ok": err < ERR_TOL})
            except Exception as e:
                checks.append({"group": name, "M": m, "error": f"{type(e).__name__}: {e}"[:300],
                               "ok": False})
            print(json.dumps(checks[-1]), flush=True)
    rows = []
    if not args.decode_only:
        deadline = start + args.budget_s
        for name, spec in groups.items():
            bench_group(name, spec, args.ms, args, deadline, rows)
    if args.write_table and rows:
        write_json(args.write_table, merged_table(
            args.write_table, best_table(rows, groups, str(jax.devices()[0].device_kind))))
        common.load_tuned.cache_clear()  # the decode steps read the new table
        jax.clear_caches()
    decode = [] if args.no_decode else bench_decode_steps(decode_models, args)
    result = {"checks": checks, "rows": rows, "decode": decode,
              "device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"),
              "command": command_line(), "host": platform.node(), "peak_TBps": PEAK_TBPS,
              "wall_s": time.perf_counter() - start}
    if args.out:
        write_json(args.out, result)
    report(result)


if __name__ == "__main__":
    main()
