"""MoE experts with many (token, expert) pairs (speculative verify, prefill) on one GPU: the
expert-major Pallas kernel (`grouped_matmul_sorted` impl "pallas") against XLA's
`lax.ragged_dot` (impl "xla"), for Qwen3-30B-A3B's expert shapes (gate/up [128, 2048, 768],
down [128, 768, 2048], bf16) at P = 128, 256, 512, 2048 pairs (T = P / 8 tokens, each
routed to 8 distinct experts drawn uniformly).

  python -m bench.bench_moe_verify --out runs/moe_verify.json           # GPU
  JAX_PLATFORMS=cpu python -m bench.bench_moe_verify --tiny --out /tmp/m.json   # CPU check

First a check per shape and P: the kernel's output against ragged_dot's on fresh random
inputs (float32 outputs: max |error| / max |ragged_dot|). Then the timing: --layers distinct
weight stacks (beyond the 50 MB L2) multiplied one after the other, `reps` times, inside one
jitted fori_loop; the time per matmul is (t(reps) - t(1)) / ((reps - 1) * layers), so
dispatch cancels (medians of --repeats calls after warm-up, each blocked until ready).
GB/s counts the bytes of the touched experts' weights (the floor: each read once); "dense GB/s"
counts all E experts. --sweep adds a few kernel configs beside the heuristic default. CPU
(--tiny): tiny shapes, the kernel in interpret mode (times meaningless). A markdown table is
printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
import zlib


from bench.common.results_io import command_line, write_json
from bench.common.timing import chained_matmuls, median_seconds

TOP_K = 8
SHAPES = {"gate/up": (128, 2048, 768), "down": (128, 768, 2048)}  # [E, K, N]
PAIRS = (128, 256, 512, 2048)
TINY_SHAPES = {"gate/up": (8, 64, 48), "down": (8, 48, 64)}
TINY_PAIRS = (16, 32)
TINY_TOP_K = 2


def routed(key, num_pairs, num_experts, top_k):
    """group_sizes [E] of num_pairs / top_k tokens, each with top_k distinct uniform experts."""
    import jax
    import jax.numpy as jnp

    scores = jax.random.uniform(key, (num_pairs // top_k, num_experts))
    experts = jnp.argsort(scores, axis=-1)[:, :top_k].reshape(-1)
    return jnp.bincount(experts, length=num_experts).astype(jnp.int32)


def configs(p, e, k, n, sweep):
    """(label, config): the heuristic default (None) first, then --sweep variations of one
    knob each."""
    from pallas_kernels.gemv.config import sorted_config

    base = sorted_config(p, e, k, n)
    more = [dict(block_n=128), dict(block_k=64), dict(num_warps=8), dict(num_stages=4),
            dict(evict_first=False), dict(row_blocks=1), dict(row_blocks=8)]
    return [("default", None)] + [(",".join(f"{a}={b}" for a, b in kw.items()),
                                   dataclasses.replace(base, **kw)) for kw in more if sweep]


def bench(name, e, k, n, p, args, rows):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.gemv import grouped_matmul_sorted

    kx, kw, ks, kc = jax.random.split(jax.random.key(zlib.crc32(f"{name} {p}".encode())), 4)
    sizes = routed(ks, p, e, args.top_k)
    touched = int(jnp.sum(sizes > 0))
    x = jax.random.normal(kx, (p, k), jnp.bfloat16)
    ws = tuple(jax.random.normal(kk, (e, k, n), jnp.bfloat16) / k**0.5
               for kk in jax.random.split(kw, args.layers))

    def mm(impl, cfg, out_dtype=None):
        return lambda x, w, s: grouped_matmul_sorted(x, w, s, impl=impl, config=cfg,
                                                     interpret=args.interpret,
                                                     out_dtype=out_dtype)

    # Check: fresh random inputs, float32 outputs, the kernel against ragged_dot.
    cx, cw = jax.random.split(kc)
    xc = jax.random.normal(cx, (p, k), jnp.bfloat16)
    wc = jax.random.normal(cw, (e, k, n), jnp.bfloat16)
    ref = np.asarray(jax.jit(mm("xla", None, jnp.float32))(xc, wc, sizes))
    bytes_touched, bytes_dense = touched * k * n * 2, e * k * n * 2
    variants = [("xla", "ragged_dot", None)] + [
        ("pallas", label, c) for label, c in configs(p, e, k, n, args.sweep)]
    for impl, label, cfg in variants:
        row = dict(shape=name, E=e, K=k, N=n, P=p, tokens=p // args.top_k, touched=touched,
                   impl=impl, variant=label,
                   config=None if cfg is None else dataclasses.asdict(cfg))
        try:
            if impl == "pallas":
                y = np.asarray(jax.jit(mm(impl, cfg, jnp.float32))(xc, wc, sizes))
                row["rel_err"] = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
            run = chained_matmuls(mm(impl, cfg))
            jax.block_until_ready(run(ws, x, sizes, 1))  # compile + warm-up
            t1 = median_seconds(run, ws, x, sizes, 1, repeats=args.repeats, warmup=1)
            tr = median_seconds(run, ws, x, sizes, args.reps, repeats=args.repeats, warmup=1)
            sec = (tr - t1) / ((args.reps - 1) * args.layers) if tr > t1 else float("nan")
            row.update(ms=sec * 1e3, GBps=bytes_touched / sec / 1e9,
                       dense_GBps=bytes_dense / sec / 1e9)
        except Exception as exc:  # noqa: BLE001 (a config that fails to compile is a result)
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)


def report(rows):
    print("\n| shape | P (tokens) | touched | impl | config | ms | GB/s touched | "
          "vs xla | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    xla = {(r["shape"], r["P"]): r.get("ms") for r in rows if r["impl"] == "xla"}
    for r in rows:
        cfg = r["variant"]
        if "error" in r:
            print(f"| {r['shape']} | {r['P']} ({r['tokens']}) | {r['touched']} | {r['impl']} | "
                  f"{cfg} | error: {r['error'][:60]} | | | |")
            continue
        base = xla.get((r["shape"], r["P"]))
        speed = f"{base / r['ms']:.2f}x" if base and r["ms"] == r["ms"] else ""
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        print(f"| {r['shape']} | {r['P']} ({r['tokens']}) | {r['touched']} | {r['impl']} | "
              f"{cfg} | {r['ms']:.4f} | {r['GBps']:.0f} | {speed} | {err} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check)")
    parser.add_argument("--pairs", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=8, help="weight stacks per rep")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also a few kernel configs")
    args = parser.parse_args()

    import jax

    args.interpret = jax.default_backend() != "gpu"  # CPU: the kernel in interpret mode
    shapes, pairs, args.top_k = SHAPES, PAIRS, TOP_K
    if args.tiny:
        shapes, pairs, args.top_k = TINY_SHAPES, TINY_PAIRS, TINY_TOP_K
        args.layers, args.reps, args.repeats = 2, 2, 3
    pairs = args.pairs or pairs
    start = time.perf_counter()
    rows = []
    for p in pairs:
        for name, (e, k, n) in shapes.items():
            bench(name, e, k, n, p, args, rows)
    result = {"rows": rows, "device": str(jax.devices()[0].device_kind),
              "date": time.strftime("%Y-%m-%d"), "command": command_line(),
              "host": platform.node(), "wall_s": time.perf_counter() - start}
    if args.out:
        write_json(args.out, result)
    report(rows)


if __name__ == "__main__":
    main()
