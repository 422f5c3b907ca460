"""Why the tied LM head contracts with `embed` as stored (`target.lm_head`): time of the SmolLM2
LM head on this machine's backend for a few rows, written as `embed.T` (the old form, which
XLA:CPU copied on every one-row call) and as `einsum("BTD,VD->BTV")` with `embed` [V, D].

  python bench/lm_head_cpu.py --out bench/results/lm_head_cpu_2026-11-29.json
"""

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import command_line, write_json  # noqa: E402

from jetspec_jax.io.convert import load_target  # noqa: E402

FORMS = {
    "embed.T": lambda h, e: jnp.einsum("BTD,DV->BTV", h, e.T, preferred_element_type=jnp.float32),
    "embed as stored": lambda h, e: jnp.einsum("BTD,VD->BTV", h, e,
                                               preferred_element_type=jnp.float32),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg, params, _ = load_target("smollm2-135m", jnp.float32, progress=False)
    embed = params["embed"]
    rows = []
    for n in args.rows:
        h = jax.random.normal(jax.random.key(0), (1, n, cfg.hidden_size), jnp.float32)
        for name, form in FORMS.items():
            fn = jax.jit(form)
            fn(h, embed).block_until_ready()
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn(h, embed).block_until_ready()
                times.append(time.perf_counter() - t)
            rows.append({"rows": n, "form": name, "ms": statistics.median(times) * 1e3})
            print(f"{n} rows, {name}: {rows[-1]['ms']:.2f} ms", flush=True)
    result = {"backend": jax.default_backend(), "machine": platform.machine(),
              "date": time.strftime("%Y-%m-%d"), "command": command_line(),
              "embed_shape": list(embed.shape), "rows": rows}
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
