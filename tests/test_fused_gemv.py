"""The fused decode-layer projections (pallas_kernels.gemv.fused): the kernel in interpret mode
against the unfused math (RMSNorm prologue, several weights, SwiGLU and residual epilogues,
with and without split-K, row and column tails), its refusals, its default config, lowering
for an H200, and tiny dense / Llama / MoE targets decoding with `matmul_impl="fused_interpret"`
exactly as with XLA, the fused path really taken."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import count_eqns, random_prompts, tiny_target
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.model import target
from pallas_kernels.gemv import fused_gemv
from pallas_kernels.gemv.fused import (FusedGemvConfig, fused_config, fused_gemv_pallas,
                                       fused_gemv_reference, table_key, tuned_fused_config)

F32, BF16 = jnp.float32, jnp.bfloat16
# Max error relative to max |reference|: summation order (f32); bf16: the norm's scale is
# applied after the product here and before it in the reference, so the inputs round apart.
TOL = {jnp.dtype(F32): 2e-5, jnp.dtype(BF16): 2e-2}

CASES = [
    # (M, K, widths, norm, residual, swiglu, config, dtype)
    (1, 256, (64, 32, 32), True, False, False, FusedGemvConfig(64, 16, num_splits=1), F32),
    (3, 300, (40, 24), True, False, False, FusedGemvConfig(64, 16, num_splits=2), F32),
    (16, 192, (48, 16, 16), True, False, False, FusedGemvConfig(64, 32, num_splits=3), BF16),
    (2, 256, (64, 64), True, False, True, FusedGemvConfig(64, 32, num_splits=1), F32),
    (5, 200, (40, 40), True, False, True, FusedGemvConfig(32, 16, num_splits=4), BF16),
    (32, 128, (48,), False, True, False, FusedGemvConfig(64, 16, num_splits=1), F32),
    (7, 200, (48,), False, True, False, FusedGemvConfig(64, 32, num_splits=2), BF16),
    (1, 96, (80,), False, False, False, FusedGemvConfig(128, 64, num_splits=1), F32),  # K < bk
    (4, 320, (72,), False, False, False, None, F32),  # heuristic config
]


def operands(m, k, widths, norm, residual, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(widths) + 3)
    x = jax.random.normal(keys[0], (m, k), F32).astype(dtype)
    ws = [(jax.random.normal(kw, (k, n), F32) / np.sqrt(k)).astype(dtype)
          for kw, n in zip(keys[3:], widths)]
    g = (1 + 0.2 * jax.random.normal(keys[1], (k,), F32)).astype(dtype) if norm else None
    r = jax.random.normal(keys[2], (m, widths[0]), F32).astype(dtype) if residual else None
    return x, ws, g, r


@pytest.mark.parametrize("m,k,widths,norm,residual,swiglu,cfg,dtype", CASES)
def test_kernel_matches_unfused(m, k, widths, norm, residual, swiglu, cfg, dtype):
    x, ws, g, r = operands(m, k, widths, norm, residual, dtype, seed=m + k)
    got = fused_gemv_pallas(x, ws, g, r, swiglu=swiglu, config=cfg, interpret=True)
    want = fused_gemv_reference(x, ws, g, r, swiglu=swiglu)
    assert len(got) == len(want) == (1 if swiglu else len(widths))
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) / np.max(np.abs(b)) < TOL[jnp.dtype(dtype)]


def test_norm_is_applied():
    """Scaling x must not change a normed product (RMSNorm is scale-free), but must change an
    unnormed one: the prologue is really there."""
    x, ws, g, _ = operands(2, 128, (32,), True, False, F32)
    cfg = FusedGemvConfig(64, 16, num_splits=1)
    normed = [fused_gemv_pallas(s * x, ws, g, config=cfg, interpret=True)[0] for s in (1, 8)]
    np.testing.assert_allclose(normed[0], normed[1], rtol=1e-4, atol=1e-5)
    plain = [fused_gemv_pallas(s * x, ws, config=cfg, interpret=True)[0] for s in (1, 8)]
    np.testing.assert_allclose(plain[1], 8 * plain[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(ws=[jnp.zeros((100, 8))]), "needs weights"),
    (dict(x=jnp.zeros((33, 64))), r"M=33 rows outside \[1, 32\]"),
    (dict(swiglu=True, ws=[jnp.zeros((64, 8)), jnp.zeros((64, 16))]), "gate and up"),
    (dict(r=jnp.zeros((2, 8)), ws=[jnp.zeros((64, 8))] * 2), "residual needs one weight"),
    (dict(g=jnp.zeros((32,))), "norm weight"),
    (dict(ws=[jnp.zeros((64, 8), BF16)]), "dtypes"),
    (dict(cfg=FusedGemvConfig(48, 16)), "block_k=48"),
])
def test_refuses_by_name(change, match):
    args = dict(x=jnp.zeros((2, 64)), ws=[jnp.zeros((64, 8))], g=None, r=None, swiglu=False,
                cfg=None)
    args.update(change)
    with pytest.raises(NotImplementedError, match=match):
        fused_gemv_pallas(args["x"], args["ws"], args["g"], args["r"], swiglu=args["swiglu"],
                          config=args["cfg"], interpret=True)


def test_api_needs_a_gpu_or_interpret():
    x, ws, _, _ = operands(1, 64, (16,), False, False, F32)
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match="NVIDIA GPU"):
            fused_gemv(x, ws)
    np.testing.assert_allclose(fused_gemv(x, ws, interpret=True)[0], x @ ws[0], rtol=1e-5)


def test_default_config_gives_about_three_programs_per_sm():
    """Qwen3-8B on 132 SMs with 128-column strips: q/k/v (48 strips) split K in 8 (the cap),
    gate and up (192 strips) in 3; never more splits than K blocks."""
    assert fused_config(4096, 48, sms=132) == FusedGemvConfig(128, 128, num_splits=8)
    assert fused_config(4096, 192, sms=132).num_splits == 3
    assert fused_config(300, 1, sms=132) == FusedGemvConfig(128, 128, num_splits=3)


def test_tuned_table_entry_serves_matching_calls(tmp_path):
    """An entry serves the same shapes, epilogue and dtype, M rounded up to a power of two;
    anything else (or no table) gets None."""
    key = table_key(3, 64, (16, 8), norm=True, residual=False, swiglu=False, dtype=F32)
    entry = {**key, "M": 3, "config": {"block_k": 32, "block_n": 16, "num_splits": 2}, "us": 1}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": [entry]}))
    assert tuned_fused_config(key, path) == FusedGemvConfig(32, 16, num_splits=2)
    assert tuned_fused_config({**key, "M": 8}, path) is None
    assert tuned_fused_config({**key, "swiglu": True}, path) is None
    assert tuned_fused_config(key, tmp_path / "none.json") is None


@pytest.mark.parametrize("widths,k,norm,residual,swiglu,splits", [
    ((4096, 1024, 1024), 4096, True, False, False, 1),  # Qwen3-8B q/k/v
    ((12288, 12288), 4096, True, False, True, 1),  # gate/up
    ((4096,), 12288, False, True, False, 1),  # down
    ((4096,), 4096, False, True, False, 4),  # o, split-K
])
def test_lowers_for_h200(widths, k, norm, residual, swiglu, splits):
    from pallas_kernels.lowering_check import lower_for_gpu

    x, g = jnp.zeros((1, k), BF16), jnp.zeros((k,), BF16) if norm else None
    ws = [jnp.zeros((k, n), BF16) for n in widths]
    r = jnp.zeros((1, widths[0]), BF16) if residual else None
    text = lower_for_gpu(lambda x, ws, g, r: fused_gemv_pallas(
        x, ws, g, r, swiglu=swiglu, config=FusedGemvConfig(num_splits=splits)), x, ws, g, r)
    assert "__gpu$xla.gpu.triton" in text


def one_token_kernels(cfg, params):
    """How many fused GEMV kernels one decode step of a batch of 2 runs."""
    cache = target.allocate_cache(cfg, 2, 8, jnp.float32)
    tokens = jnp.zeros((2, 1), jnp.int32)
    return count_eqns(lambda p: target.forward(
        p, cfg, tokens, tokens, cache, jnp.zeros((2,), jnp.int32))[0], params, name="fused_gemv")


@pytest.mark.parametrize("kind", ["dense", "llama", "moe"])
def test_greedy_decode_identical_with_fused_layers(kind):
    """float32 tiny targets decode the same tokens with the fused one-token layers (interpret
    mode) as with XLA; the decode steps really run 4 kernels a layer (2 for MoE)."""
    cfg, params = tiny_target(kind, seed=5, vocab=32)
    fused = cfg.replace(matmul_impl="fused_interpret")
    assert one_token_kernels(fused, params) == cfg.num_layers * (2 if kind == "moe" else 4)
    assert one_token_kernels(cfg.replace(matmul_impl="xla"), params) == 0
    prompt, lens = random_prompts(np.random.default_rng(1), 3, 6, cfg.vocab_size)
    kw = dict(max_new=8, sampler=Sampler(), stop_ids=(), num_slots=32)
    want = ar_generate(params, prompt, lens, jax.random.key(0),
                       cfg=cfg.replace(matmul_impl="xla"), **kw)
    got = ar_generate(params, prompt, lens, jax.random.key(0), cfg=fused, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))


def test_fused_step_matches_unfused_hidden_states():
    """One decode step's final hidden states and written K/V, fused against XLA (float32)."""
    cfg, params = tiny_target("dense", seed=7, vocab=32)
    cache = target.allocate_cache(cfg, 3, 8, jnp.float32)
    tokens = jnp.array([[3], [9], [30]], jnp.int32)
    positions = jnp.array([[0], [0], [0]], jnp.int32)
    start = jnp.zeros((3,), jnp.int32)
    outs = [target.forward(params, cfg.replace(matmul_impl=impl), tokens, positions, cache,
                           start) for impl in ("xla", "fused_interpret")]
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[1][1].k + outs[1][1].v, outs[0][1].k + outs[0][1].v):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
