"""Where a profiled run spent its device time: reads the Perfetto trace that
`jax.profiler.trace(dir, create_perfetto_trace=True)` writes and prints, per device, the span,
the busy time (union of its op intervals), and the ops with the most total time.

  python -m bench.trace_summary TRACE_DIR [--match GPU | CPU] [--top 12]

The busy/span ratio separates a device that computes slowly from one that waits (on the host,
a collective, or another device).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def load_events(trace_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir} (was the trace "
                                "taken with create_perfetto_trace=True?)")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


# On the CPU the ops run on XLA's Eigen threads inside the host process, wrapped in the
# executor's own events (each spans the ops it runs).
CPU_OP_THREAD = "tf_XLAEigen"
CPU_WRAPPERS = ("ThunkExecutor", "SlinkyThreadPool")


def summarise(events: list[dict], match: str = "GPU", top: int = 12) -> dict:
    """-> {process name: {"span_us", "busy_us", "ops": [(name, total_us, count), ...]}} for
    the processes whose name contains `match`; match "CPU": the XLA ops of the host's threads
    (busy: the union over its threads)."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}

    def kept(e):
        if match != "CPU":
            return True
        return (threads.get((e["pid"], e.get("tid")), "").startswith(CPU_OP_THREAD)
                and not e["name"].startswith(CPU_WRAPPERS))

    per_pid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and match in names.get(e.get("pid"), "") and kept(e):
            per_pid[e["pid"]].append(e)
    out = {}
    for pid, evs in per_pid.items():
        intervals = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in evs]
        totals, counts = collections.Counter(), collections.Counter()
        for e in evs:
            totals[e["name"]] += e.get("dur", 0.0)
            counts[e["name"]] += 1
        out[names[pid]] = {
            "span_us": max(e for _, e in intervals) - min(s for s, _ in intervals),
            "busy_us": busy_time(intervals),
            "ops": [(n, t, counts[n]) for n, t in totals.most_common(top)]}
    return out


def format_summary(summary: dict) -> str:
    lines = []
    for proc, s in summary.items():
        lines.append(f"{proc}: span {s['span_us'] / 1e3:.2f} ms, busy {s['busy_us'] / 1e3:.2f} "
                     f"ms ({s['busy_us'] / max(s['span_us'], 1e-9):.0%})")
        lines += [f"  {t / 1e3:9.3f} ms  x{c:<5d} {n[:100]}" for n, t, c in s["ops"]]
    return "\n".join(lines)


def profile(fn, *args, trace_dir: str, top: int = 12) -> str:
    """Runs `fn(*args)` once untraced (compile, warm-up) and once traced into `trace_dir`;
    returns the per-device summary of the traced run."""
    import jax  # here so that reading a trace needs no jax

    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    match = "GPU" if jax.default_backend() == "gpu" else "CPU"
    return format_summary(summarise(load_events(trace_dir), match, top=top))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir")
    ap.add_argument("--match", default="GPU", help="keep processes whose name contains this "
                    "(CPU: the host's XLA ops)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    print(format_summary(summarise(load_events(args.trace_dir), args.match, args.top)))


if __name__ == "__main__":
    main()
