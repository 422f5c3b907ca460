"""Streaming against the whole loop, in one run: `api.stream` (one compiled call and one read-back
to the host per chunk of rounds or steps) against `api.generate` (the whole generation in one
on-device loop), on the same prompts, with the tokens checked equal. Each time includes the
prefill; compilation is excluded. Repeats are interleaved (whole, chunk 1, chunk 4, whole, ...)
and each variant's median is reported.

  python -m bench.bench_stream --model qwen3-8b --out runs/stream.json
      # random bf16 weights (fused layout on a GPU) and a random reference-sized head
  python -m bench.bench_stream --model smollm2-135m     # its shipped head (GPU: stage first)
  python -m bench.bench_stream --quick                  # CPU check: a tiny random model
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time


from bench.common.results_io import command_line, write_json


MODELS = ("qwen3-8b", "qwen3-30b-a3b", "smollm2-135m", "tiny")


def add_model_options(parser, *, model: str, dtype: str) -> None:
    """--model (one of MODELS, as `load` reads it) and --dtype, with these defaults."""
    parser.add_argument("--model", default=model, choices=MODELS)
    parser.add_argument("--dtype", default=dtype, choices=["bfloat16", "float32"])


def random_models(cfg, dtype):
    """A Target and a Draft of random weights: a reference-sized head (5 layers, block 16),
    two layers and block 6 for a tiny target."""
    import jax

    from bench.common.models import random_params
    from jetspec_jax.draft import head as draft_head
    from jetspec_jax.io.load import Draft, Target
    from jetspec_jax.model import layout, params as P

    tparams = random_params(P.target_specs(cfg), dtype)
    if jax.default_backend() == "gpu":  # as `load_target` lays weights out on one GPU
        tparams = layout.fuse_projections(tparams, in_place=True)
    tiny = cfg.num_layers < 8
    dcfg = draft_head.draft_config_for(cfg, num_layers=2 if tiny else 5,
                                       block_size=6 if tiny else 16, num_taps=2 if tiny else 5)
    return (Target(cfg, tparams, None, cfg.name),
            Draft(dcfg, random_params(draft_head.draft_specs(dcfg), dtype), "<random>"))


def load(name: str, dtype: str):
    from jetspec_jax import api
    from jetspec_jax.model import config

    if name == "smollm2-135m":
        target = api.load_target(name, dtype=dtype)
        return target, api.load_draft(api.default_draft_path(target.name), target)
    return random_models(config.preset(name) if name != "tiny" else config.tiny_dense(
        vocab_size=64, num_layers=3), dtype)


def stream_seconds(make_chunks, want):
    """Seconds to iterate one stream (its programs already compiled), checking its tokens."""
    chunks = make_chunks()  # compiles on the first call, found compiled after
    start = time.perf_counter()
    got = None
    for chunk in chunks:
        got = chunk.tokens if got is None else [a + b for a, b in zip(got, chunk.tokens)]
    seconds = time.perf_counter() - start
    if got != want:
        raise AssertionError("streamed tokens differ from generate's")
    return seconds


def run(args):
    import jax
    import numpy as np

    from jetspec_jax import api

    api.exact_float32(args.dtype)
    target, draft = load(args.model, args.dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.cfg.vocab_size, args.prompt_len).tolist()
               for _ in range(args.batch)]
    kw = dict(max_new_tokens=args.max_new, stop_ids=(), budget=args.budget,
              attn_impl=args.attn_impl)
    rows = []
    for mode, head in (("speculative", draft), ("autoregressive", None)):
        ref = api.generate(target, prompts, draft=head, **kw)  # compiles; the tokens to match
        variants = {"whole": lambda: api.generate(target, prompts, draft=head, **kw).seconds}
        for chunk in args.chunks:
            variants[chunk] = lambda chunk=chunk: stream_seconds(
                lambda: api.stream(target, prompts, draft=head, chunk=chunk, **kw), ref.tokens)
        # Interleaved repeats after a warm-up of each, so that a drifting machine (a busy CPU)
        # shifts every variant alike; the median of each.
        times = {name: [] for name in variants}
        for rep in range(args.repeats + 1):
            for name, fn in variants.items():
                seconds = fn()
                if rep:
                    times[name].append(seconds)
        rounds = max(ref.rounds) if head is not None else None
        steps = rounds if head is not None else max(map(len, ref.tokens)) - 1
        base = statistics.median(times["whole"])
        for name, ts in times.items():
            secs = statistics.median(ts)
            rows.append(dict(mode=mode, chunk=name,
                             calls=1 if name == "whole" else 1 + -(-steps // name),
                             seconds=secs, seconds_all=ts, tokens=ref.num_generated,
                             ms_per_token=1e3 * secs / ref.num_generated * args.batch,
                             rounds=rounds, vs_whole=secs / base))
            print(rows[-1], flush=True)
    return dict(rows=rows, model=args.model, draft=draft.path, dtype=args.dtype,
                batch=args.batch, prompt_len=args.prompt_len, max_new=args.max_new,
                budget=args.budget,
                attn_impl=api.resolve_kernels(target, args.attn_impl).attention_name,
                device=str(jax.devices()[0].device_kind), host=platform.node(),
                date=time.strftime("%Y-%m-%d"), command=command_line())


def table(result) -> str:
    lines = [f"{result['model']}, batch {result['batch']}, prompt {result['prompt_len']}, "
             f"{result['max_new']} new tokens, budget {result['budget']}, {result['dtype']}, "
             f"{result['device']}, {result['date']}", "",
             "| mode | chunk | calls | ms per token (a sequence's) | vs the whole loop |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['chunk']} | {r['calls']} | {r['ms_per_token']:.3f} | "
                     f"{r['vs_whole']:.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser, model="qwen3-8b", dtype="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each variant (after one warm-up)")
    parser.add_argument("--attn-impl", default="auto")
    parser.add_argument("--quick", action="store_true", help="tiny random model (CPU check)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.model, args.dtype, args.prompt_len, args.max_new, args.repeats = (
            "tiny", "float32", 8, 8, 1)
        args.budget, args.chunks = 4, [2]
    result = run(args)
    print(table(result))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
