"""Where the compile time of one decoding program goes: the same speculative (and autoregressive)
program compiled from scratch under several settings, each in a fresh process (XLA reads its
flags once), with the persistent compilation cache off.

On the H200 one SmolLM2 evaluation program (compare_heads: float32, batch 192) took 45-147 s to
compile, against ~3 s on the CPU, and `--xla_gpu_autotune_level=0` did not shorten it. This
script names the part of the GPU compile that costs: our Pallas kernels (attn "reference"
removes them), XLA's Triton gemms, autotuning, command buffers, float32 at `highest` precision
(the same programs in bfloat16 compiled in about half the time in session 9).

  python bench/compile_probe.py --out $OUT/compile_probe.json            # on the GPU
  python bench/compile_probe.py --model tiny-dense --settings default attn_reference
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import command_line, write_json  # noqa: E402

# name -> (XLA_FLAGS, attn_impl, dtype): float32 runs at `highest` matmul precision (as
# compare_heads' float32 runs do); bfloat16 at the default precision.
SETTINGS = {
    "default": ("", "auto", "float32"),
    "attn_reference": ("", "reference", "float32"),
    "no_triton_gemm": ("--xla_gpu_enable_triton_gemm=false", "auto", "float32"),
    "autotune_0": ("--xla_gpu_autotune_level=0", "auto", "float32"),
    "no_command_buffer": ("--xla_gpu_enable_command_buffer=", "auto", "float32"),
    "all_off": ("--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0 "
                "--xla_gpu_enable_command_buffer=", "reference", "float32"),
    "bfloat16": ("", "auto", "bfloat16"),
}


def child(args) -> None:
    """Builds random weights (args.dtype) of the preset and a 2-layer head (the shipped head's
    shape), then lowers and compiles `spec_generate` and `ar_generate` once each, printing one
    JSON line per step as it ends, so that a setting cut by its timeout still tells where it
    was."""
    import jax
    import jax.numpy as jnp

    from bench_decode import random_params
    from jetspec_jax import api
    from jetspec_jax.decode.autoregressive import ar_generate
    from jetspec_jax.decode.sampling import Sampler
    from jetspec_jax.decode.speculative import TreeSpec, spec_generate
    from jetspec_jax.draft import head as draft_head
    from jetspec_jax.model import config, params as P

    started = time.perf_counter()
    jax.config.update("jax_enable_compilation_cache", False)
    dtype = jnp.dtype(args.dtype)
    api.exact_float32(dtype)  # float32 at `highest`, as compare_heads runs it
    tcfg = config.preset(args.model)
    tp = random_params(P.target_specs(tcfg), dtype)
    dcfg = draft_head.draft_config_for(tcfg, num_layers=2, block_size=16, num_taps=3)
    dp = random_params(draft_head.draft_specs(dcfg), dtype)
    prompt = jnp.zeros((args.batch, args.prompt_len), jnp.int32)
    lens = jnp.full((args.batch,), args.prompt_len, jnp.int32)
    common = dict(max_new=args.max_new, sampler=Sampler(), stop_ids=(), cache_dtype=dtype,
                  num_slots=args.prompt_len + args.max_new + args.budget + 32,
                  attn_impl=api.resolve_attn_impl(args.attn_impl))  # "auto": the CPU's
    programs = {
        f"spec_b{args.budget}": lambda: spec_generate.lower(
            tp, dp, prompt, lens, jax.random.key(2), tcfg=tcfg, dcfg=dcfg,
            tree_spec=TreeSpec(args.budget, 7), **common),
        "ar": lambda: ar_generate.lower(tp, prompt, lens, jax.random.key(2), cfg=tcfg, **common),
    }
    emit = lambda **kv: print(json.dumps(kv), flush=True)  # noqa: E731
    emit(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
         setup_s=round(time.perf_counter() - started, 2))
    for name, lower in programs.items():
        t0 = time.perf_counter()
        lowered = lower()
        emit(**{name: {"lower_s": round(time.perf_counter() - t0, 2),
                       "stablehlo_lines": lowered.as_text().count("\n")}})
        t1 = time.perf_counter()
        lowered.compile()
        emit(**{name: {"compile_s": round(time.perf_counter() - t1, 2)}})


def merge_lines(stdout: str) -> dict:
    """The child's JSON lines merged into one dict (a program's entries into one)."""
    out = {}
    for line in stdout.splitlines():
        try:
            part = json.loads(line)
        except json.JSONDecodeError:
            continue
        for k, v in part.items():
            out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def run_setting(name: str, args) -> dict:
    flags, attn, dtype = SETTINGS[name]
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    cmd = [sys.executable, __file__, "--child", "--attn-impl", attn, "--dtype", dtype,
           "--model", args.model,
           "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
           "--budget", str(args.budget), "--max-new", str(args.max_new)]
    row = {"setting": name, "xla_flags": flags, "attn_impl": attn, "dtype": dtype}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout_s)
    except subprocess.TimeoutExpired as cut:  # keep the steps that ended before the cut
        stdout = cut.stdout.decode() if isinstance(cut.stdout, bytes) else cut.stdout or ""
        return {**row, **merge_lines(stdout), "error": f"over {args.timeout_s} s"}
    row.update(merge_lines(proc.stdout), process_s=round(time.perf_counter() - t0, 1))
    if proc.returncode != 0:
        row["error"] = (proc.stderr or proc.stdout)[-600:]
    return row


def table(rows: list[dict]) -> str:
    programs = list(dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, dict)))
    lines = ["| setting | XLA_FLAGS | attn | dtype | set-up s | " + " | ".join(
        f"{p} compile s (lower s)" for p in programs) + " | error |",
        "|---|---|---|---|---|" + "---|" * (len(programs) + 1)]

    def cell(step: dict | None) -> str:
        if not step:
            return "-"
        lower = f"({step['lower_s']:.1f})"
        return f"{step['compile_s']:.1f} {lower}" if "compile_s" in step else f"cut {lower}"

    for r in rows:
        error = r.get("error", "").strip().splitlines()
        lines.append(f"| {r['setting']} | `{r.get('xla_flags') or '-'}` | "
                     f"{r.get('attn_impl', '-')} | {r.get('dtype', 'float32')} | "
                     f"{r.get('setup_s', '-')} | "
                     + " | ".join(cell(r.get(p)) for p in programs)
                     + f" | {error[-1][:80] if error else ''} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="config preset (random weights)")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per setting")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attn-impl", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return
    result = {"command": command_line(), "date": time.strftime("%Y-%m-%d"),
              "args": vars(args), "rows": []}
    for name in args.settings:
        result["rows"].append(run_setting(name, args))
        print(json.dumps(result["rows"][-1]), flush=True)
        if args.out:
            write_json(args.out, result)
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
