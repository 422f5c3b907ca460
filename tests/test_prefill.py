"""Chunked prefill: the prompt in passes of `chunk` tokens gives what one pass gives (logits,
cache, taps), and decoding on top of it stays lossless."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import loop_args, random_prompts, tiny_head, tiny_target
from jetspec_jax.decode import autoregressive as decode
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.speculative import TreeSpec, spec_generate
from jetspec_jax.model import target
from test_speculative import assert_same, run_both


@pytest.mark.parametrize("kind,width,chunk", [
    ("dense", 13, 4),   # three whole chunks in the scan, then a remainder of 1
    ("llama", 12, 4),   # whole chunks only
    ("moe", 9, 8),      # one whole chunk, then a remainder
    ("dense", 5, 8),    # shorter than a chunk: one pass
])
def test_chunked_prefill_equals_one_pass(kind, width, chunk):
    cfg, params = tiny_target(kind, seed=2, vocab=20)
    prompt, lens = random_prompts(np.random.default_rng(width), 3, width, cfg.vocab_size)
    taps = (0, 2)

    def run(chunk):
        cache = target.allocate_cache(cfg, 3, 24, jnp.float32)
        return jax.jit(lambda c: decode.prefill(params, cfg, prompt, lens, c, taps=taps,
                                                chunk=chunk))(cache)

    (logits, cache, tapped), (want_logits, want_cache, want_taps) = run(chunk), run(width)
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(tapped, want_taps, atol=1e-5, rtol=1e-5)
    assert tapped.shape == (3, width, len(taps) * cfg.hidden_size)
    for got, want in zip(cache.k + cache.v, want_cache.k + want_cache.v):
        np.testing.assert_allclose(got[:, :, :width], want[:, :, :width], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache.lengths, lens)


@pytest.mark.parametrize("seed", range(3))
def test_decoding_with_chunked_prefill_is_unchanged_and_lossless(seed):
    rng = np.random.default_rng(seed)
    tcfg, tp = tiny_target(("dense", "moe", "llama")[seed], seed=seed, vocab=12)
    dcfg, dp = tiny_head(tcfg, seed=seed + 7, block_size=6)
    prompt, lens = random_prompts(rng, 3, 7, tcfg.vocab_size)  # test_speculative's AR program
    runs = []
    for chunk in (3, 64):  # chunks of 3 tokens, then the 7-token prompts in one pass
        runs.append(run_both(tcfg, tp, dcfg, dp, prompt, lens, TreeSpec(16, 3),
                             prefill_chunk=chunk))
    (ar, sd, _), (ar_one_pass, sd_one_pass, _) = runs
    assert_same(ar, sd)
    assert_same(ar, ar_one_pass)
    assert_same(sd, sd_one_pass)


def test_the_prefill_chunk_is_a_static_argument_of_the_decoders():
    """Changing it compiles another program (no stale trace is reused), for AR and JetSpec
    decoding alike (EAGLE-style: tests/lab/test_eagle.py)."""
    tcfg, tp = tiny_target("dense", vocab=12)
    dcfg, dp = tiny_head(tcfg, block_size=4)
    prompt, lens = random_prompts(np.random.default_rng(0), 2, 9, tcfg.vocab_size)
    kw = dict(max_new=4, num_slots=40)
    lower = {
        "ar": lambda c: ar_generate.lower(tp, prompt, lens, jax.random.key(0), cfg=tcfg,
                                          **loop_args(prefill_chunk=c, **kw)),
        "spec": lambda c: spec_generate.lower(tp, dp, prompt, lens, jax.random.key(0), tcfg=tcfg,
                                              dcfg=dcfg, tree_spec=TreeSpec(8, 3),
                                              **loop_args(prefill_chunk=c, **kw)),
    }
    for name, fn in lower.items():
        one_pass, chunked = fn(64).as_text(), fn(4).as_text()
        assert one_pass != chunked, name
        assert chunked == fn(4).as_text(), name


@pytest.mark.parametrize("chunk", [0, -4])
def test_prefill_refuses_a_chunk_below_one_token(chunk):
    cfg, params = tiny_target("dense", vocab=20)
    prompt, lens = random_prompts(np.random.default_rng(0), 2, 6, cfg.vocab_size)
    cache = target.allocate_cache(cfg, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match=f"prefill_chunk must be a whole number >= 1, got {chunk}"):
        decode.prefill(params, cfg, prompt, lens, cache, chunk=chunk)
