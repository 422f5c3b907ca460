"""Does an L2 prefetch issued before latency-bound kernels speed up the matmul after them?
A chain of L layers, each: [prefetch of w_l] -> a window of small dependent kernels -> x @ w_l.
Timed per layer for: the window alone, the matmul alone, the matmul twice on the same w (does
a second read find w in L2?), window + matmul, and prefetch + window + matmul (several prefetch
sizes); also how often the optimized HLO names "mosaic", to show the prefetch kernels are in
the program (XLA drops a kernel whose output nobody reads).

  python3 bench/probe_l2_prefetch.py --out $OUT/l2_probe.json       # H200, ~1 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import command_line, write_json  # noqa: E402
from timing import loop_seconds  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--window", type=int, default=6, help="small kernels per window")
    parser.add_argument("--mbs", type=float, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from pallas_kernels.l2_prefetch import l2_prefetch

    keys = jax.random.split(jax.random.key(0), args.layers + 2)
    ws = [jax.random.normal(k, (args.k, args.n), jnp.bfloat16) for k in keys[:-2]]
    small = jax.random.normal(keys[-2], (args.window, 128, 128), jnp.float32) * 0.05
    x0 = jax.random.normal(keys[-1], (1, args.k), jnp.bfloat16)
    interpret = jax.default_backend() != "gpu"

    def window(x):  # dependent tiny matmuls: one launch-bound kernel each
        h = x[:, :128].astype(jnp.float32)
        for i in range(args.window):
            h = jnp.tanh(h @ small[i])
        return x.at[:, :128].add(h.astype(x.dtype) * 1e-3)

    def chain(with_window, matmuls, mb):
        def layers(ws, x):
            for w in ws:
                if mb:
                    x = l2_prefetch(x, [w], int(mb * 2**20), interpret=interpret)
                if with_window:
                    x = window(x)
                for _ in range(matmuls):  # a second pass reads w again: from L2?
                    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
                    x = (y[:, :args.k] * 1e-2).astype(x.dtype)
            return x

        @jax.jit
        def run(ws, x, reps):
            return jax.lax.fori_loop(0, reps, lambda _, x: layers(ws, x), x)

        return run

    variants = [("window", True, 0, 0), ("matmul", False, 1, 0),
                ("matmul twice, same w", False, 2, 0), ("window+matmul", True, 1, 0)]
    variants += [(f"prefetch {mb:g} MB+window+matmul", True, 1, mb) for mb in args.mbs]
    variants += [(f"prefetch {args.mbs[-1]:g} MB+window", True, 0, args.mbs[-1])]
    rows = []
    for name, win, matmuls, mb in variants:
        fn = chain(win, matmuls, mb)
        hlo = fn.lower(ws, x0, 1).compile().as_text()
        per, compile_s, _ = loop_seconds(fn, ws, x0, reps=8, repeats=15)
        row = {"variant": name, "us_per_layer": per / args.layers * 1e6,
               "mosaic_calls": hlo.lower().count("mosaic"), "compile_s": compile_s}
        rows.append(row)
        print(json.dumps(row), flush=True)
    mm_bytes = args.k * args.n * 2
    print('\n| variant | us per layer | HLO "mosaic" mentions |\n|---|---|---|')
    for r in rows:
        print(f"| {r['variant']} | {r['us_per_layer']:.2f} | {r['mosaic_calls']} |")
    print(f"matmul bytes {mm_bytes / 2**20:.0f} MB: {mm_bytes / 4.25e6:.2f} us at 4.25 TB/s")
    if args.out:
        write_json(args.out, {"device": jax.devices()[0].device_kind, "command": command_line(),
                              "date": time.strftime("%Y-%m-%d"), "rows": rows})


if __name__ == "__main__":
    main()
