"""The peer benchmarks (bench/peers): llama.cpp's timing lines parse into tokens and seconds,
the table's speedups are over the fastest peer's autoregressive decoding, and, where torch is
installed, the PyTorch decode's greedy tokens equal our float32 AR tokens on a tiny model."""

from __future__ import annotations

import argparse

import pytest
from helpers import tiny_target

from bench.peers import llama_cpp, run_all

COMPLETION_LOG = """
llama_perf_sampler_print:    sampling time =      10.00 ms /   300 runs   (    0.03 ms per token)
llama_perf_context_print:        load time =     120.00 ms
llama_perf_context_print: prompt eval time =      50.00 ms /    44 tokens (    1.14 ms per token)
llama_perf_context_print:        eval time =    2550.00 ms /   255 runs   (   10.00 ms per token)
llama_perf_context_print:       total time =    2700.00 ms /   299 tokens
"""
LOOKUP_LOG = """
encoded   44 tokens in    0.050 seconds, speed:  880.000 t/s
decoded  130 tokens in    1.000 seconds, speed:  130.000 t/s

n_draft      = 8
n_predict    = 130
n_drafted    = 200
t_draft_flat = 0.10 ms
n_accept     = 50
accept       = 25.000%
"""


def test_llama_cpp_timing_lines_parse():
    r = llama_cpp.parse("completion", COMPLETION_LOG)
    # The first token comes from the prompt's pass; load time is not counted.
    assert r == dict(tokens=256, seconds=2.6, decode_s=2.55, decode_steps=255)
    r = llama_cpp.parse("lookup", LOOKUP_LOG)
    assert r == dict(tokens=130, seconds=1.05, decode_s=1.0, decode_steps=130, drafted=200,
                     accepted=50)
    with pytest.raises(ValueError):
        llama_cpp.parse("completion", "error: failed to load model")


def test_a_missing_tool_is_recorded_not_fatal(tmp_path):
    ap = argparse.ArgumentParser()
    llama_cpp.add_options(ap)
    args = ap.parse_args(["--bin", str(tmp_path), "--modes", "completion", "spec-draft"])
    args.gguf, args.max_new = tmp_path / "m.gguf", 4
    rows = llama_cpp.run(args, ["hi"])["modes"]
    assert [r["mode"] for r in rows] == ["completion", "spec-draft"]
    assert all("error" in r for r in rows)


def test_table_speedups_are_over_the_fastest_peer_ar():
    rows = [dict(engine="jetspec_jax", mode="autoregressive", ar=True, tokens_per_s=300.0,
                 ms_per_token=3.3),
            dict(engine="jetspec_jax", mode="speculative (budget 16)", ar=False,
                 tokens_per_s=600.0, ms_per_token=1.7),
            dict(engine="torch_decode", mode="autoregressive", ar=True, tokens_per_s=200.0,
                 ms_per_token=5.0),
            dict(engine="llama.cpp", mode="bench", ar=True, same_prompts=False,
                 tokens_per_s=900.0, ms_per_token=1.1),
            dict(engine="llama.cpp", mode="lookup", ar=False, error="exit 1")]
    lines = run_all.table(rows).splitlines()
    assert lines[1].split()[-1] == "1.50" and lines[2].split()[-1] == "3.00"
    assert lines[3].split()[-1] == "1.00"  # llama-bench has no prompt: not the reference
    assert "error" in lines[5]


def test_torch_decode_equals_our_float32_ar_on_a_tiny_model():
    torch = pytest.importorskip("torch")
    from bench.peers import reference, torch_decode
    from jetspec_jax import api
    from jetspec_jax.io.load import Target

    api.exact_float32("float32")
    cfg, params = tiny_target("llama", vocab=64, scale=3.0)  # varied tokens, not one repeated
    ids = [[1, 5, 9, 3, 7], [7, 2]]
    ours = reference.generate(Target(cfg, params, None, cfg.name), ids, max_new=12)
    meta = reference.bundle_meta(cfg, ids, ours["tokens"], dtype="float32", max_new=12)
    result = torch_decode.run(meta, reference.params_arrays(params), device="cpu",
                              dtype=torch.float32, graph=False)
    assert result["identical_prompts"] == 2 and result["tokens"] == 24
