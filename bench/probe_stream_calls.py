"""What one streamed call costs: the compiled continuation of `api.stream` called on its own,
for several chunk sizes. Per call: milliseconds per step or round (median), minor page faults
(`getrusage`), and the executable's temporary buffer; also a call whose loop runs nothing
(every sequence marked done) and the read-back of the tokens.

  python bench/probe_stream_calls.py --out bench/results/stream_calls_cpu_<date>.json
  python bench/probe_stream_calls.py --quick      # CPU check: a tiny random model
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_stream import add_model_options, load  # noqa: E402
from results_io import command_line, write_json  # noqa: E402


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_calls(advance, params, state, calls):
    """-> (the state after, seconds of each call, minor faults of each call)."""
    import jax

    seconds, faults = [], []
    for _ in range(calls):
        f, t = minor_faults(), time.perf_counter()
        state = jax.block_until_ready(advance(*params, state))
        seconds.append(time.perf_counter() - t)
        faults.append(minor_faults() - f)
    return state, seconds, faults


def probe(target, head, prompts, kw, chunk, calls):
    import jax

    from jetspec_jax import api
    from jetspec_jax.decode import streaming

    run = api._prepare(target, prompts, head, **kw)
    params = (run.tparams,) if head is None else (run.tparams, run.dparams)
    steps = (streaming.ar_steps(target.cfg, run.static, chunk) if head is None else
             streaming.spec_steps(target.cfg, head.dcfg, run.spec, run.static, chunk))
    start, _ = api._compiled(steps.start, (*params, *run.args), steps.start_static)
    advance, _ = api._compiled(steps.advance, (*params, start.out_info), steps.advance_static)
    state = advance(*params, start(*params, *run.args))  # a first call, untimed
    state, seconds, faults = time_calls(advance, params, state, calls)
    t = time.perf_counter()
    jax.device_get(state.out)
    read_s = time.perf_counter() - t
    done = state.replace(out=state.out.replace(done=jax.numpy.ones_like(state.out.done)))
    _, idle, _ = time_calls(advance, params, done, calls)
    return dict(chunk=chunk, calls=calls, ms_per_step=1e3 * statistics.median(seconds) / chunk,
                faults_per_call=statistics.median(faults),
                temp_mb=advance.memory_analysis().temp_size_in_bytes / 1e6,
                idle_call_ms=1e3 * statistics.median(idle), read_back_ms=1e3 * read_s,
                unfinished=not bool(state.out.done.all()))


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(parser, model="smollm2-135m", dtype="float32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=32, help="steps timed per chunk size")
    parser.add_argument("--quick", action="store_true", help="tiny random model (CPU check)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.model, args.prompt_len, args.chunks, args.steps = "tiny", 8, [1, 2], 4

    import jax
    import numpy as np

    from jetspec_jax import api

    api.exact_float32(args.dtype)
    target, draft = load(args.model, args.dtype)
    prompts = [np.random.default_rng(0).integers(3, target.cfg.vocab_size,
                                                 args.prompt_len).tolist()]
    # Room for the timed calls and the untimed first one at up to 16 tokens a round, so
    # that no sequence finishes before the idle call (rows say "unfinished").
    kw = dict(max_new_tokens=16 * (args.steps + 2 * max(args.chunks)), stop_ids=(),
              budget=args.budget)
    rows = []
    for mode, head in (("autoregressive", None), ("speculative", draft)):
        for chunk in args.chunks:
            rows.append(dict(mode=mode, **probe(target, head, prompts, kw, chunk,
                                                max(2, args.steps // chunk))))
            print(rows[-1], flush=True)
    result = dict(rows=rows, model=args.model, dtype=args.dtype, budget=args.budget,
                  prompt_len=args.prompt_len, device=str(jax.devices()[0].device_kind),
                  host=platform.node(), date=time.strftime("%Y-%m-%d"), command=command_line())
    print("| mode | chunk | ms per step/round | minor faults a call | temp MB | idle call ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['chunk']} | {r['ms_per_step']:.2f} | "
              f"{r['faults_per_call']:.0f} | {r['temp_mb']:.1f} | {r['idle_call_ms']:.2f} |")
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
