"""The Mosaic GPU weight-streaming kernel for sm_90 (pallas_kernels/gemv/hopper.py) in Mosaic
GPU interpret mode against a float32 product (rows 1 to 32, split-K, both tile widths,
several ring depths), with the race detector, its refusals by name, lowering for an H200,
the api's "mosaic" impl and a tiny target decoding with it exactly as with XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax.experimental.pallas.mosaic_gpu as plgpu

from helpers import count_eqns, random_prompts, tiny_target
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.sampling import Sampler
from pallas_kernels.gemv import small_m_matmul
from pallas_kernels.gemv.hopper import (HopperGemvConfig, auto_splits, hopper_config,
                                        small_m_matmul_hopper)

BF16 = jnp.bfloat16

CASES = [
    # (M, K, N, config)
    (1, 256, 128, HopperGemvConfig(64, 64, stages=2, num_splits=1)),
    (3, 512, 256, HopperGemvConfig(128, 128, stages=3, num_splits=2)),
    (17, 384, 64, HopperGemvConfig(64, 64, stages=4, num_splits=3)),  # ragged splits
    (32, 256, 128, None),  # default config
]


def operands(m, k, n, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m, k), BF16), jax.random.normal(kw, (k, n), BF16)


@pytest.mark.parametrize("m,k,n,cfg", CASES)
def test_kernel_matches_float32_product(m, k, n, cfg):
    x, w = operands(m, k, n, seed=m)
    got = small_m_matmul_hopper(x, w, config=cfg, interpret=True, out_dtype=jnp.float32)
    want = x.astype(jnp.float32) @ w.astype(jnp.float32)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-5
    default = small_m_matmul_hopper(x, w, config=cfg, interpret=True)
    assert default.dtype == BF16


def test_ring_has_no_races():
    """TMA refills of a slot must not overlap the wgmma reading it."""
    x, w = operands(2, 512, 64)
    got = small_m_matmul_hopper(
        x, w, config=HopperGemvConfig(64, 64, stages=2, num_splits=1),
        interpret=plgpu.InterpretGPUParams(detect_races=True), out_dtype=jnp.float32)
    np.testing.assert_allclose(got, x.astype(jnp.float32) @ w.astype(jnp.float32),
                               rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("x_shape,w_shape,dtype,cfg,match", [
    ((1, 200), (200, 64), BF16, None, "not a multiple of the tile"),
    ((1, 128), (128, 96), BF16, None, "not a multiple of the tile"),
    ((33, 128), (128, 64), BF16, None, "M=33"),
    ((1, 128), (128, 64), jnp.float32, None, "bf16 or f16"),
    ((1, 128), (128, 64), BF16, HopperGemvConfig(128, 32), "block_n 64 or 128"),
    ((1, 512), (512, 128), BF16, HopperGemvConfig(512, 128, stages=4), "shared memory"),
])
def test_refuses_by_name(x_shape, w_shape, dtype, cfg, match):
    with pytest.raises(NotImplementedError, match=match):
        small_m_matmul_hopper(jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype),
                              config=cfg, interpret=True)


def test_default_config_and_splits():
    assert hopper_config(4096, 4096) == HopperGemvConfig(block_k=128, block_n=64)
    assert hopper_config(192, 64).block_k == 64
    # q/o on 132 SMs: 64 strips of 64 columns, 5 splits for about two programs per SM
    assert auto_splits(4096, 4096, HopperGemvConfig(), sms=132) == 5
    assert auto_splits(128, 151936, HopperGemvConfig(), sms=132) == 1


@pytest.mark.parametrize("m,k,n", [(1, 4096, 12288), (1, 12288, 4096), (4, 4096, 151936)])
def test_lowers_for_h200(m, k, n):
    from pallas_kernels.lowering_check import lower_for_gpu

    text = lower_for_gpu(small_m_matmul_hopper, jnp.zeros((m, k), BF16), jnp.zeros((k, n), BF16))
    assert "mosaic_gpu" in text


def test_api_mosaic_impl_needs_a_gpu_or_interpret():
    """Off-GPU "mosaic" is XLA; with interpret=True the kernel; shapes it refuses fall back."""
    x, w = operands(2, 128, 64)
    want = jnp.dot(x, w, preferred_element_type=jnp.float32)
    for interpret in (False, True):
        got = small_m_matmul(x, w, impl="mosaic", interpret=interpret, out_dtype=jnp.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
    odd = small_m_matmul(x[:, :100], w[:100], impl="mosaic", interpret=True)
    np.testing.assert_allclose(odd.astype(jnp.float32),
                               jnp.dot(x[:, :100], w[:100]).astype(jnp.float32), rtol=1e-2)


def test_greedy_decode_identical_with_mosaic_matmul():
    """A tiny bf16 target decodes the same tokens with the kernel on every projection it
    serves (interpret mode) as with XLA, and the kernel really runs."""
    cfg, params = tiny_target("dense", seed=4, vocab=128, hidden_size=128, num_heads=4,
                              num_kv_heads=4, head_dim=32, intermediate_size=256)
    params = jax.tree.map(lambda a: a.astype(BF16), params)
    mosaic = cfg.replace(matmul_impl="mosaic_interpret")
    prompt, lens = random_prompts(np.random.default_rng(2), 2, 5, cfg.vocab_size)
    kw = dict(max_new=4, sampler=Sampler(), stop_ids=(), num_slots=16, cache_dtype=BF16)
    kernels = count_eqns(lambda p: ar_generate(p, prompt, lens, jax.random.key(0), cfg=mosaic,
                                               **kw), params, primitive="wgmma_ref")
    assert kernels > 0
    want = ar_generate(params, prompt, lens, jax.random.key(0),
                       cfg=cfg.replace(matmul_impl="xla"), **kw)
    got = ar_generate(params, prompt, lens, jax.random.key(0), cfg=mosaic, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
