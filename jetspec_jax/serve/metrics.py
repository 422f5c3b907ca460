"""Counters and gauges of the server, written in the Prometheus text format at /metrics."""

from __future__ import annotations

import threading

PREFIX = "jetspec_"
HELP = {  # name -> (type, help)
    "requests": ("counter", "requests finished, by outcome (stop, length, cancelled, error)"),
    "rejected": ("counter", "requests refused before they were queued, by reason"),
    "prompt_tokens": ("counter", "prompt tokens prefilled"),
    "prefill_tokens": ("counter", "tokens run through prefill passes, the padding included"),
    "generated_tokens": ("counter", "tokens generated"),
    "rounds": ("counter", "speculative rounds run, counted after each device call"),
    "accepted_tokens": ("counter", "tokens those rounds committed"),
    "round_tokens": ("gauge", "tokens committed per speculative round in the last device call"),
    "queue_depth": ("gauge", "requests waiting for a slot"),
    "slots_active": ("gauge", "batch slots holding a request, counted as they join and leave"),
    "prefilling": ("gauge", "requests being prefilled, out of the queue and not yet in a slot"),
    "slots_total": ("gauge", "batch slots on the device"),
    "kv_blocks_used": ("gauge", "paged KV cache blocks held by requests (--kv-block-size)"),
    "kv_blocks_free": ("gauge", "paged KV cache blocks free in the pool"),
    "kv_blocks_reserved": ("gauge", "paged KV cache blocks reserved by the admitted requests "
                           "(each one's worst case; a request waits for its own to fit)"),
}


class Metrics:
    """Thread-safe: the engine thread counts, the HTTP side reads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.values: dict[tuple[str, tuple], float] = {}

    def count(self, name: str, amount: float = 1, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self.lock:
            self.values[key] = self.values.get(key, 0) + amount

    def set(self, name: str, value: float, **labels) -> None:
        with self.lock:
            self.values[(name, tuple(sorted(labels.items())))] = value

    def get(self, name: str, **labels) -> float:
        with self.lock:
            return self.values.get((name, tuple(sorted(labels.items()))), 0)

    def text(self) -> str:
        """The Prometheus text exposition; tau (tokens per speculative round) is derived."""
        with self.lock:
            values = dict(self.values)
        lines = []
        for name, (kind, help_text) in HELP.items():
            full = PREFIX + name + ("_total" if kind == "counter" else "")
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
            series = [(k[1], v) for k, v in values.items() if k[0] == name] or [((), 0)]
            for labels, value in sorted(series):
                tags = ",".join(f'{k}="{v}"' for k, v in labels)
                lines.append(f"{full}{{{tags}}} {value:g}" if tags else f"{full} {value:g}")
        rounds = values.get(("rounds", ()), 0)
        tau = values.get(("accepted_tokens", ()), 0) / rounds if rounds else 0
        lines += [f"# HELP {PREFIX}tau mean tokens committed per speculative round",
                  f"# TYPE {PREFIX}tau gauge", f"{PREFIX}tau {tau:g}"]
        return "\n".join(lines) + "\n"
