"""Weight-streaming microbenchmark: which weight layout and XLA flags let a batch-1 decode step
read bf16 weights fastest. Each flag set runs in its own process (XLA reads flags at start).

  python bench/bench_gemv.py            # runs every variant, prints a table
"""

import json
import os
import statistics
import subprocess
import sys
import time

FLAG_SETS = {
    "default": "",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    "cublaslt": "--xla_gpu_enable_cublaslt=true",
}


def child():
    import jax
    import jax.numpy as jnp

    d, f, layers = 4096, 12288, 12  # 1.2 GB of weights per layout: several times the L2
    key = jax.random.key(0)
    x = jax.random.normal(key, (1, d), jnp.bfloat16)
    results = {}
    for layout, shape, eq in [("in_out [D,F]", (layers, d, f), "bd,ldf->lbf"),
                              ("out_in [F,D]", (layers, f, d), "bd,lfd->lbf")]:
        w = jax.random.normal(key, shape, jnp.bfloat16)
        fn = jax.jit(lambda w, x, eq=eq: jnp.einsum(eq, x, w))
        fn(w, x).block_until_ready()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            fn(w, x).block_until_ready()
            times.append(time.perf_counter() - t)
        results[layout] = w.size * 2 / statistics.median(times) / 1e12
        del w
    print(json.dumps(results))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child()
    rows = []
    for name, flags in FLAG_SETS.items():
        env = dict(os.environ, XLA_FLAGS=flags)
        out = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True,
                             text=True, timeout=120)
        try:
            rows.append((name, json.loads(out.stdout.strip().splitlines()[-1])))
        except (IndexError, json.JSONDecodeError):
            rows.append((name, {"error": out.stderr[-300:]}))
    print("| flags | layout | TB/s |\n|---|---|---|")
    for name, res in rows:
        for layout, bw in res.items():
            print(f"| {name} | {layout} | {bw if isinstance(bw, str) else f'{bw:.2f}'} |")


if __name__ == "__main__":
    main()
