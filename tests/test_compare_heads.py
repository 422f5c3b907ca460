"""bench/compare_heads.py's report of a result file that several invocations extended."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import compare_heads  # noqa: E402


def cell(bench: str, head: str, hist: list[int]) -> dict:
    return dict(benchmark=bench, head=head, budget=16, tau=0.0, tau_hist=hist, identical=2,
                num_prompts=2, seconds=1.0, compile_s=2.0)


def test_markdown_keeps_cells_of_benchmarks_a_later_run_did_not_ask_for():
    args = dict(temperature=0.0, width=7, max_new_tokens=8, per_benchmark=0, one_batch=False,
                benchmarks=["mtbench"])  # the last invocation's; humaneval came before
    cells = {"mtbench/jetspec/16": cell("mtbench", "jetspec", [0, 2, 2]),
             "humaneval/jetspec/16": cell("humaneval", "jetspec", [0, 0, 2])}
    result = dict(args=args, backend="cpu", machine="x", date="d", model="m",
                  command="second", commands=["first", "second"], head_paths={"jetspec": "p"},
                  cells=cells)
    text = compare_heads.markdown(result)
    rows = [line for line in text.splitlines() if line.startswith("| humaneval")
            or line.startswith("| mtbench")]
    assert [r.split(" | ")[0] for r in rows] == ["| humaneval", "| mtbench"]  # BENCHMARKS order
    # Pooled over both benchmarks' rounds: (1*2 + 2*2 + 2*2) tokens / 6 rounds
    assert "| jetspec | 1.67 | 4/4 |" in text
    assert "commands (in order; each resumed the last): `first`, `second`" in text


def test_in_batches_splits_in_order_and_merges():
    calls = []

    def run(prompts):  # stands in for run_autoregressive: a dict of lists and seconds
        calls.append(list(prompts))
        return {"tokens": [[len(p)] for p in prompts], "prompt_lens": [len(p) for p in prompts],
                "seconds": 1.5, "compile_s": 0.5}

    prompts = ["a", "bb", "ccc", "dddd", "eeeee"]
    merged = compare_heads.in_batches(run, prompts, 2)
    assert calls == [["a", "bb"], ["ccc", "dddd"], ["eeeee"]]
    assert merged == {"tokens": [[1], [2], [3], [4], [5]], "prompt_lens": [1, 2, 3, 4, 5],
                      "seconds": 4.5, "compile_s": 1.5}
    as_tuple = compare_heads.in_batches(lambda ps: ([[0]] * len(ps), [[1]] * len(ps), 2.0, 1.0),
                                        prompts, 4)
    assert as_tuple == ([[0]] * 5, [[1]] * 5, 4.0, 2.0)
    calls.clear()
    assert compare_heads.in_batches(run, prompts, 0)["seconds"] == 1.5 and len(calls) == 1


def test_stored_ar_is_reused_only_for_the_same_batch_and_sampler():
    ar = {"tokens": [[1, 2], [3]], "max_new": 8}  # a greedy run of an older file: no temperature
    assert compare_heads.reusable_ar(ar, 2, 8, 0.0)
    assert not compare_heads.reusable_ar(ar, 2, 8, 1.0)  # a sampled run needs its own AR
    assert not compare_heads.reusable_ar(ar, 3, 8, 0.0)
    assert not compare_heads.reusable_ar(ar, 2, 16, 0.0)
    assert not compare_heads.reusable_ar(None, 2, 8, 0.0)
    assert compare_heads.reusable_ar(dict(ar, temperature=1.0), 2, 8, 1.0)


def test_speedup_is_throughput_over_ar():
    greedy = dict(tokens=100, seconds=2.0, ar_seconds=3.0)  # older files: no ar_tokens
    assert compare_heads.speedup(greedy) == 1.5
    sampled = dict(tokens=100, seconds=2.0, ar_seconds=3.0, ar_tokens=120)
    assert abs(compare_heads.speedup(sampled) - 50 / 40) < 1e-12
    assert compare_heads.speedup(dict(tokens=1, seconds=1.0, ar_seconds=None)) is None


def test_a_bfloat16_run_does_not_resume_float32_cells():
    old = {"cells": {"humaneval/jetspec/16": {}}}  # written before --dtype: float32
    assert compare_heads.other_dtype(old, "bfloat16") == "float32"
    assert compare_heads.other_dtype(old, "float32") is None
    assert compare_heads.other_dtype({**old, "dtype": "bfloat16"}, "bfloat16") is None
    assert compare_heads.other_dtype({"cells": {}}, "bfloat16") is None  # nothing to mix
