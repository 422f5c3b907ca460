"""Batch-1 autoregressive decode speed on one GPU against the memory-bandwidth floor and
against transformers' `generate` on the same card.

Weights are random bf16 of the real shapes (speed does not depend on their values).
Run (on the GPU machine; the two stages are separate processes so JAX and PyTorch do not
compete for device memory):
  python -m bench.bench_decode jax --out runs/decode_jax.json
  python -m bench.bench_decode hf  --out runs/decode_hf.json
  python -m bench.bench_decode report runs/decode_jax.json runs/decode_hf.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from pathlib import Path


from bench.common.models import kv_bytes_per_token, random_params, weight_bytes_per_token
from bench.common.results_io import command_line, write_json
from bench.common.timing import median_seconds

MODELS = ("smollm2-135m", "qwen3-8b", "qwen3-30b-a3b")


def measure_bandwidth():
    """Weight-streaming bandwidth (bf16 GEMV over 2 GB) and copy bandwidth (read + write)."""
    import jax
    import jax.numpy as jnp

    w = jax.random.normal(jax.random.key(0), (8, 8192, 16384), jnp.bfloat16)  # 2.1 GB
    x = jax.random.normal(jax.random.key(1), (1, 8192), jnp.bfloat16)
    gemv = jax.jit(lambda w, x: jnp.einsum("bd,ldf->lbf", x, w))
    t = median_seconds(gemv, w, x, repeats=10)
    stream = w.size * 2 / t
    a = jax.random.normal(jax.random.key(2), (1024, 1024, 1024), jnp.bfloat16)  # 2.1 GB
    scale = jax.jit(lambda a: a * 1.5)
    t = median_seconds(scale, a, repeats=10)
    copy = 2 * a.size * 2 / t
    del w, a
    return stream, copy


def bench_jax(args):
    import jax
    import jax.numpy as jnp

    from jetspec_jax.model import config, params as P
    from jetspec_jax.model.kernels import choose
    from jetspec_jax.model.layout import fuse_projections

    stream_bw, copy_bw = measure_bandwidth()
    print(f"bandwidth: weight streaming {stream_bw / 1e12:.2f} TB/s, copy {copy_bw / 1e12:.2f} TB/s",
          flush=True)
    rows = []
    for name in args.models:
        cfg = config.preset(name)
        specs = P.target_specs(cfg)
        t0 = time.perf_counter()
        params = random_params(specs)
        jax.block_until_ready(params)
        init_s = time.perf_counter() - t0
        for layout in args.layouts:  # the same weights each time, in either order
            timed = (jax.block_until_ready(jax.jit(fuse_projections)(params))
                     if layout == "fused" else params)  # q/k/v, gate/up concatenated
            for impl in args.attn_impls:
                kernels = choose(impl, moe=cfg.is_moe)
                rows.append({**time_model(cfg, timed, args.context, kernels, stream_bw),
                             "layout": layout})
                print(json.dumps(rows[-1]), flush=True)
            del timed
        del params
        jax.clear_caches()
        rows[-1]["init_s"] = init_s
    return {"stream_bw": stream_bw, "copy_bw": copy_bw, "rows": rows}


def time_model(cfg, params, context, kernels, stream_bw):
    """ms per token of batch-1 decoding with these `Kernels` (and the bandwidth floor)."""
    import jax
    import jax.numpy as jnp

    from jetspec_jax.decode.autoregressive import decode_step, prefill
    from jetspec_jax.decode.sampling import Sampler
    from jetspec_jax.model import target

    num_slots = context + 512
    greedy = Sampler()

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def run_prefill(params, cache, prompt):
        lens = jnp.full((1,), prompt.shape[1], jnp.int32)
        logits, cache, _ = prefill(params, cfg, prompt, lens, cache, kernels=kernels)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def run_decode(params, cache, last, steps):
        done = jnp.zeros((1,), bool)

        def body(i, carry):
            cache, last = carry
            nxt, cache = decode_step(params, cfg, cache, last, jax.random.key(0), greedy, done,
                                     kernels)
            return cache, nxt

        cache, last = jax.lax.fori_loop(0, steps, body, (cache, last))
        return last, cache

    prompt = jax.random.randint(jax.random.key(1), (1, context), 0, cfg.vocab_size, jnp.int32)
    cache = target.allocate_cache(cfg, 1, num_slots, jnp.bfloat16)
    t = time.perf_counter()
    compiled_prefill = run_prefill.lower(params, cache, prompt).compile()
    compiled_decode = run_decode.lower(params, cache, prompt[:, 0], 1).compile()
    compile_s = time.perf_counter() - t

    def decode(steps):
        cache = target.allocate_cache(cfg, 1, num_slots, jnp.bfloat16)
        last, cache = compiled_prefill(params, cache, prompt)
        last.block_until_ready()
        t = time.perf_counter()
        last, cache = compiled_decode(params, cache, last, steps)
        last.block_until_ready()
        return time.perf_counter() - t

    decode(8)
    short = statistics.median(decode(16) for _ in range(3))
    long = statistics.median(decode(272) for _ in range(3))
    per_token = (long - short) / 256
    wbytes = weight_bytes_per_token(cfg)
    kvbytes = kv_bytes_per_token(cfg, context + 144)
    floor = (wbytes + kvbytes) / stream_bw
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "model": cfg.name, "attn_impl": kernels.attention_name, "context": context,
        "ms_per_token": per_token * 1e3, "tok_s": 1 / per_token,
        "floor_ms": floor * 1e3, "fraction_of_floor": floor / per_token,
        "achieved_TBps": (wbytes + kvbytes) / per_token / 1e12,
        "weight_GB": wbytes / 1e9, "kv_GB": kvbytes / 1e9, "compile_s": compile_s,
        "peak_GB": stats.get("peak_bytes_in_use", 0) / 1e9,
    }


def hf_config(cfg):
    import transformers

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  intermediate_size=cfg.intermediate_size, rope_theta=cfg.rope_theta,
                  rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                  max_position_embeddings=cfg.max_position_embeddings)
    if cfg.is_moe:
        return transformers.Qwen3MoeConfig(
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
            **common)
    if not cfg.qk_norm:
        return transformers.LlamaConfig(**common)
    return transformers.Qwen3Config(**common)


def bench_hf(args):
    import torch
    import transformers

    from jetspec_jax.model import config

    rows = []
    for name in args.models:
        cfg = config.preset(name)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(
                hf_config(cfg), dtype=torch.bfloat16)
        model.eval()
        prompt = torch.randint(0, cfg.vocab_size, (1, args.context), device="cuda")

        def gen(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        gen(4)
        short = statistics.median(gen(8) for _ in range(2))
        long = statistics.median(gen(72) for _ in range(2))
        per_token = (long - short) / 64
        rows.append({"model": cfg.name, "context": args.context, "hf_ms_per_token": per_token * 1e3,
                     "hf_tok_s": 1 / per_token, "transformers": transformers.__version__,
                     "torch": torch.__version__})
        print(json.dumps(rows[-1]), flush=True)
        del model
        torch.cuda.empty_cache()
    return {"rows": rows}


def report(jax_path, hf_path):
    ours = json.loads(Path(jax_path).read_text())
    hf = {r["model"]: r for r in json.loads(Path(hf_path).read_text())["rows"]} if hf_path else {}
    lines = [
        f"measured weight streaming {ours['stream_bw'] / 1e12:.2f} TB/s, copy "
        f"{ours['copy_bw'] / 1e12:.2f} TB/s",
        "| model | attention | weights | ctx | ms/token | tok/s | floor ms | % of floor | TB/s | "
        "transformers tok/s | compile s | peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ours["rows"]:
        h = hf.get(r["model"], {})
        lines.append(
            f"| {r['model']} | {r['attn_impl']} | {r.get('layout', 'separate')} | "
            f"{r['context']} | {r['ms_per_token']:.3f} | "
            f"{r['tok_s']:.0f} | {r['floor_ms']:.3f} | {100 * r['fraction_of_floor']:.0f}% | "
            f"{r['achieved_TBps']:.2f} | {h.get('hf_tok_s', float('nan')):.1f} | "
            f"{r['compile_s']:.1f} | {r['peak_GB']:.1f} |")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["jax", "hf", "report"])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--attn-impls", nargs="+", default=["reference"],
                        help="attention kernels timed in turn (`jetspec_jax.model.kernels`)")
    parser.add_argument("--layouts", nargs="+", default=["separate"],
                        choices=["separate", "fused"],
                        help="weight layouts timed in turn, same weights: fused = q/k/v and "
                             "gate/up concatenated (jetspec_jax.model.layout)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.stage == "report":
        return report(args.files[0], args.files[1] if len(args.files) > 1 else None)
    result = bench_jax(args) if args.stage == "jax" else bench_hf(args)
    result.update(device=_device_name(args.stage), date=time.strftime("%Y-%m-%d"),
                  command=command_line(), host=platform.node())
    if args.out:
        write_json(args.out, result)


def _device_name(stage):
    if stage == "hf":
        import torch

        return torch.cuda.get_device_name(0)
    import jax

    return str(jax.devices()[0].device_kind)


if __name__ == "__main__":
    main()
