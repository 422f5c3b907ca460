"""Device memory a decoding program needs, from XLA's analysis of the compiled program: nothing
runs, and the weights are abstract (random weights of the preset's real shapes).

  python bench/memory_probe.py --shapes 311x832x1024 64x832x1024      # batch x prompt x slots
  python bench/memory_probe.py --shapes 311x832x1024 --prefill-chunks 100000 256  # one pass, 256

It found why all 311 MATH500 prompts in one batch ran out of the CPU's 24 GB (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import command_line, write_json  # noqa: E402

GIB = 2 ** 30


def analyse(cfg, params, batch: int, width: int, slots: int, max_new: int,
            prefill_chunk: int) -> dict:
    """Memory analysis of `ar_generate` for one batch shape, in bytes."""
    import jax
    import jax.numpy as jnp

    from jetspec_jax.decode.autoregressive import ar_generate
    from jetspec_jax.decode.sampling import Sampler
    from jetspec_jax.model import target

    start = time.perf_counter()
    compiled = ar_generate.lower(
        params, jax.ShapeDtypeStruct((batch, width), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32), jax.random.key(0), cfg=cfg, max_new=max_new,
        sampler=Sampler(), stop_ids=(), num_slots=slots, attn_impl="reference",
        cache_dtype=jnp.float32, prefill_chunk=prefill_chunk).compile()
    m = compiled.memory_analysis()
    return {"batch": batch, "prompt": width, "slots": slots,
            "temp_bytes": m.temp_size_in_bytes, "args_bytes": m.argument_size_in_bytes,
            "kv_cache_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
                jax.eval_shape(lambda: target.allocate_cache(cfg, batch, slots, jnp.float32))
            ) if x.ndim == 4),  # K and V of every layer, not the lengths
            "compile_s": round(time.perf_counter() - start, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="config preset")
    ap.add_argument("--shapes", nargs="+", required=True, metavar="BxPxS",
                    help="batch x padded prompt width x cache slots")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prefill-chunks", type=int, nargs="+", default=None,
                    help="prefill chunks (ar_generate's prefill_chunk) to analyse (default: "
                         "decode.PREFILL_CHUNK)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        shapes = [tuple(int(n) for n in s.lower().split("x")) for s in args.shapes]
        assert all(len(s) == 3 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        ap.error(f"--shapes takes BATCHxPROMPTxSLOTS with positive numbers, got {args.shapes}")

    import jax
    import jax.numpy as jnp

    from jetspec_jax.decode import autoregressive as decode
    from jetspec_jax.model import config, params as P

    cfg = config.preset(args.model)
    params = jax.eval_shape(lambda k: P.init_params(P.target_specs(cfg), k, jnp.float32),
                            jax.random.key(0))
    rows = []
    print(f"{args.model}, float32, backend {jax.default_backend()}")
    print("| prefill chunk | batch | prompt | slots | temporaries GiB | KV cache GiB | "
          "weights + inputs GiB |\n|---|---|---|---|---|---|---|")
    for chunk in args.prefill_chunks or [decode.PREFILL_CHUNK]:
        for batch, width, slots in shapes:
            r = {"prefill_chunk": chunk, **analyse(cfg, params, batch, width, slots,
                                                   args.max_new, chunk)}
            rows.append(r)
            print(f"| {chunk} | {batch} | {width} | {slots} | {r['temp_bytes'] / GIB:.2f} | "
                  f"{r['kv_cache_bytes'] / GIB:.2f} | {r['args_bytes'] / GIB:.2f} |", flush=True)
    if args.out:
        write_json(args.out, {"command": command_line(), "date": time.strftime("%Y-%m-%d"),
                              "backend": jax.default_backend(), "model": args.model,
                              "rows": rows})


if __name__ == "__main__":
    main()
