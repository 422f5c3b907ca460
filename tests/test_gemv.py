"""Small-M weight-streaming matmuls (pallas_kernels.gemv): the dense and the grouped (MoE)
kernels and the expert-major kernel for many pairs in interpret mode against their references
(ragged_dot for the latter), the api's fallbacks and tuned table, lowering for an H200, and
tiny dense / MoE models decoding with them.

Interpret mode costs ~1 s per new shape on CPU (and grows with the grid), so the grids are
curated: M (pairs P) in {1, 2, 3, 4, 8, 16, 32}, K and N multiples and non-multiples of the
blocks, 1 to several splits (incl. more than there are K blocks), both the dot and the
broadcast-reduce forms, float32 / bf16 inputs, repeated experts.
"""

import dataclasses
import json
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import loop_args, random_prompts, tiny_target
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.model import layers
from jetspec_jax.model.kernels import Kernels
from pallas_kernels import common
from pallas_kernels.gemv import (api, grouped_matmul_sorted, grouped_small_m_matmul,
                                 small_m_matmul)
from pallas_kernels.gemv.config import (GemvConfig, SortedConfig, auto_num_splits, gemv_config,
                                        grouped_config, sorted_config, tuned_gemv_config)
from pallas_kernels.gemv.expert_major import grouped_matmul_sorted_pallas
from pallas_kernels.gemv.grouped import grouped_small_m_matmul_pallas
from pallas_kernels.gemv.kernel import small_m_matmul_pallas
from pallas_kernels.gemv.reference import (grouped_matmul_sorted_reference,
                                           grouped_small_m_matmul_reference,
                                           small_m_matmul_reference)

F32, BF16 = jnp.float32, jnp.bfloat16
PALLAS = Kernels(matmul=("pallas", "xla"), interpret=True)  # the kernels in interpret mode
# Max error relative to max |reference|: summation order (f32) or one bf16 rounding of the output.
TOL = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 1e-2}

CASES = [
    # (M, K, N, config, input dtype, out dtype or None); M = 16 and 32 need no row mask
    (1, 256, 128, GemvConfig(block_k=64, block_n=64, num_splits=1), F32, None),
    (1, 300, 200, GemvConfig(block_k=64, block_n=64, num_splits=3), BF16, None),
    (3, 512, 96, GemvConfig(block_k=128, block_n=32, num_splits=2), F32, None),
    (3, 100, 48, GemvConfig(block_k=32, block_n=16, num_splits=8), BF16, F32),  # splits > blocks
    (16, 96, 40, GemvConfig(block_k=128, block_n=64, num_splits=1), F32, None),  # K < block_k
    (16, 128, 256, GemvConfig(block_k=32, block_n=128, num_splits=1), BF16, None),
    (32, 200, 130, GemvConfig(block_k=64, block_n=64, num_splits=2), BF16, None),
    (32, 1000, 64, None, F32, None),  # heuristic config
    (2, 300, 200, GemvConfig(block_k=64, block_n=64, num_splits=2, use_dot=False), F32, None),
    (4, 256, 100, GemvConfig(block_k=32, block_n=64, num_splits=1, use_dot=False), BF16, F32),
]


def forbid_kernel(monkeypatch, name: str) -> None:
    """Makes pallas_kernels.gemv.api's kernel `name` fail if called: on a CPU without
    interpret=True, the default list must not reach it."""
    def boom(*a, **kw):
        raise AssertionError(f"{name} called on CPU")

    monkeypatch.setattr(api, name, boom)


def operands(m, k, n, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m, k), dtype), jax.random.normal(kw, (k, n), dtype)


def rel_err(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("m,k,n,cfg,dtype,out_dtype", CASES, ids=lambda v: str(v))
def test_kernel_matches_reference(m, k, n, cfg, dtype, out_dtype):
    x, w = operands(m, k, n, dtype)
    y = small_m_matmul_pallas(x, w, out_dtype=out_dtype, config=cfg, interpret=True)
    ref = small_m_matmul_reference(x, w, out_dtype)
    assert y.shape == (m, n) and y.dtype == ref.dtype
    assert rel_err(y, ref) <= TOL[jnp.dtype(out_dtype or dtype)]


def test_api_impls_and_fallback(monkeypatch):
    x, w = operands(3, 96, 40, F32)
    ref = small_m_matmul_reference(x, w)
    np.testing.assert_allclose(small_m_matmul(x, w, impl="xla"), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(small_m_matmul(x, w, impl="pallas", interpret=True), ref,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown matmul impl"):
        small_m_matmul(x, w, impl="cublas")
    # Cases the kernel cannot serve: forced -> NotImplementedError; the default list -> XLA.
    x33, w33 = operands(33, 96, 40, F32)
    with pytest.raises(NotImplementedError, match="rows"):
        small_m_matmul(x33, w33, impl="pallas", interpret=True)
    np.testing.assert_allclose(small_m_matmul(x33, w33, interpret=True),
                               small_m_matmul_reference(x33, w33), rtol=1e-5, atol=1e-5)
    mixed = small_m_matmul(x, w.astype(BF16), interpret=True)  # dtype mismatch
    assert mixed.dtype == F32
    with pytest.raises(NotImplementedError, match="overflow"):  # abstract: nothing allocated
        jax.eval_shape(small_m_matmul_pallas, jax.ShapeDtypeStruct((1, 2**16), BF16),
                       jax.ShapeDtypeStruct((2**16, 2**15), BF16))
    with pytest.raises(NotImplementedError, match="broadcast-reduce"):
        small_m_matmul_pallas(*operands(8, 64, 32, F32), config=GemvConfig(use_dot=False),
                              interpret=True)

    # On a CPU without interpret=True, auto never reaches the kernel.
    forbid_kernel(monkeypatch, "small_m_matmul_pallas")
    np.testing.assert_allclose(small_m_matmul(x, w), ref, rtol=1e-5, atol=1e-5)


def test_split_heuristic_fills_an_h200():
    """Qwen3-8B decode shapes at M=1: about 2 or more programs per SM (132 SMs), even splits;
    at M=32 the float32 partials stay within 1/16 of the weight bytes."""
    for k, n in [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096), (4096, 151936)]:
        cfg = gemv_config(1, k, n, sms=132)
        k_blocks = -(-k // cfg.block_k)
        assert k_blocks % cfg.num_splits == 0
        assert -(-n // cfg.block_n) * cfg.num_splits >= 256
        s32 = auto_num_splits(32, k, n, cfg.block_k, cfg.block_n, sms=132)
        assert 8 * s32 * 32 * n <= k * n * 2 / 16
    # Qwen3-30B-A3B experts, P = 8 pairs (batch 1): the pairs' strips count too.
    for k, n in [(2048, 768), (768, 2048)]:
        cfg = grouped_config(8, k, n, sms=132)
        assert (k // cfg.block_k) % cfg.num_splits == 0
        assert 8 * -(-n // cfg.block_n) * cfg.num_splits >= 256


@pytest.mark.parametrize("m,k,n,cfg,out_dtype", [
    (1, 4096, 1024, None, None),
    (32, 4096, 12288, None, None),
    (1, 4096, 151936, None, F32),
    (3, 1000, 300, GemvConfig(block_k=64, block_n=128, num_splits=4, use_dot=False), None),
])
def test_lowers_for_h200(m, k, n, cfg, out_dtype):
    """Pallas -> Triton lowering for an abstract H200 (no GPU needed)."""
    from pallas_kernels.lowering_check import lower_for_gpu

    x, w = jnp.zeros((m, k), BF16), jnp.zeros((k, n), BF16)
    text = lower_for_gpu(small_m_matmul_pallas, x, w, out_dtype=out_dtype, config=cfg)
    assert "__gpu$xla.gpu.triton" in text


def test_project_matches_einsum():
    key = jax.random.key(3)
    out = jax.random.normal(key, (2, 3, 4, 16), F32)  # [B, T, N, H]
    wo = jax.random.normal(jax.random.key(4), (4, 16, 24), F32)  # [N, H, D]
    want = jnp.einsum("BTNH,NHD->BTD", out, wo)
    got = layers.project("BTNH,NHD->BTD", out, wo, PALLAS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="trailing axes"):
        layers.project("BTD,FD->BTF", out[..., 0, :], wo[0], PALLAS)


def test_greedy_decode_identical_with_pallas_matmul():
    """A tiny float32 target decodes the same tokens with the kernel (interpret mode; prefill
    of 3 x 7 = 21 rows and decode steps of 3 rows both go through it) as with XLA."""
    cfg, params = tiny_target("dense", seed=2, vocab=16)
    prompt, lens = random_prompts(np.random.default_rng(0), 3, 7, cfg.vocab_size)
    kw = dict(max_new=6, num_slots=32)
    want = ar_generate(params, prompt, lens, jax.random.key(0), cfg=cfg, **loop_args(**kw))
    got = ar_generate(params, prompt, lens, jax.random.key(0), cfg=cfg,
                      **loop_args(kernels=PALLAS, **kw))
    np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


GROUPED_CASES = [
    # (experts [P] ids, E, K, N, config, input dtype, out dtype or None)
    ([2], 4, 256, 128, GemvConfig(block_k=64, block_n=64, num_splits=1), F32, None),
    ([2, 2, 0], 5, 300, 200, GemvConfig(block_k=64, block_n=64, num_splits=3), BF16, None),
    ([7, 1, 1, 3, 0, 7, 5, 2], 8, 100, 48, GemvConfig(block_k=32, block_n=16, num_splits=8),
     BF16, F32),  # splits > K blocks, N tail
    ([3, 0, 2, 1, 3, 3, 0, 2], 4, 200, 130, GemvConfig(block_k=64, block_n=64, num_splits=2,
                                                       use_dot=False), F32, None),
    (list(range(16, 0, -1)), 17, 96, 40, GemvConfig(block_k=128, block_n=64, num_splits=1),
     F32, None),  # K < block_k
    ([i % 5 for i in range(32)], 6, 160, 64, None, BF16, None),  # heuristic config
    ([i * 7 % 40 for i in range(32)], 40, 64, 32, GemvConfig(block_k=32, block_n=32,
                                                             use_dot=False), BF16, F32),
]


def grouped_operands(num_pairs, e, k, n, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (num_pairs, k), dtype), jax.random.normal(kw, (e, k, n), dtype)


@pytest.mark.parametrize("experts,e,k,n,cfg,dtype,out_dtype", GROUPED_CASES,
                         ids=lambda v: str(v)[:40])
def test_grouped_kernel_matches_reference(experts, e, k, n, cfg, dtype, out_dtype):
    x, w = grouped_operands(len(experts), e, k, n, dtype)
    ids = jnp.asarray(experts, jnp.int32)
    y = grouped_small_m_matmul_pallas(x, w, ids, out_dtype=out_dtype, config=cfg,
                                      interpret=True)
    ref = grouped_small_m_matmul_reference(x, w, ids, out_dtype)
    assert y.shape == (len(experts), n) and y.dtype == ref.dtype
    assert rel_err(y, ref) <= TOL[jnp.dtype(out_dtype or dtype)]


def test_grouped_api_impls_and_fallback(monkeypatch):
    x, w = grouped_operands(3, 4, 96, 40, F32)
    ids = jnp.asarray([3, 0, 3], jnp.int32)
    ref = grouped_small_m_matmul_reference(x, w, ids)
    for impl in ("xla", "pallas", None):
        np.testing.assert_allclose(grouped_small_m_matmul(x, w, ids, impl=impl, interpret=True),
                                   ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown matmul impl"):
        grouped_small_m_matmul(x, w, ids, impl="tuned")
    x33 = jnp.ones((33, 96), F32)  # more pairs than the kernel takes
    ids33 = jnp.zeros((33,), jnp.int32)
    with pytest.raises(NotImplementedError, match="pairs"):
        grouped_small_m_matmul(x33, w, ids33, impl="pallas", interpret=True)
    np.testing.assert_allclose(grouped_small_m_matmul(x33, w, ids33, interpret=True),
                               grouped_small_m_matmul_reference(x33, w, ids33), rtol=1e-5)

    forbid_kernel(monkeypatch, "grouped_small_m_matmul_pallas")
    np.testing.assert_allclose(grouped_small_m_matmul(x, w, ids), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_pairs,e,k,n,cfg", [
    (8, 128, 2048, 768, None),  # Qwen3-30B-A3B gate/up, batch 1
    (32, 128, 768, 2048, None),  # down, batch 4
    (3, 6, 1000, 300, GemvConfig(block_k=64, block_n=128, num_splits=4, use_dot=False)),
])
def test_grouped_lowers_for_h200(num_pairs, e, k, n, cfg):
    from pallas_kernels.lowering_check import lower_for_gpu

    x, w = jnp.zeros((num_pairs, k), BF16), jnp.zeros((e, k, n), BF16)
    ids = jnp.zeros((num_pairs,), jnp.int32)
    text = lower_for_gpu(grouped_small_m_matmul_pallas, x, w, ids, config=cfg)
    assert "__gpu$xla.gpu.triton" in text


SHIPPED_TABLE = Path(api.__file__).parent / "tuned_h200.json"


def test_tuned_table_lookup():
    """The shipped H200 table: the kernel only where it won at M=1 (k/v, gate/up, LM head)
    and M=4 (LM head, serving M=3 too); XLA (None) for q/o, down, other M, other dtypes."""
    def look(m, k, n, dtype=BF16):
        return tuned_gemv_config(m, k, n, dtype, path=SHIPPED_TABLE)

    kv = look(1, 4096, 1024)
    assert kv is not None and kv.block_n == 64 and kv.num_splits == 16
    assert look(1, 4096, 12288) is not None and look(1, 4096, 151936).num_splits == 1
    assert look(4, 4096, 151936) is not None and look(3, 4096, 151936) is not None
    for m, k, n in [(1, 4096, 4096), (1, 12288, 4096), (2, 4096, 1024), (4, 4096, 12288)]:
        assert look(m, k, n) is None
    assert look(1, 4096, 1024, F32) is None
    assert tuned_gemv_config(1, 4096, 1024, BF16) is None  # CPU: no device table


def test_tuned_impl_uses_the_table(tmp_path, monkeypatch):
    """impl ("tuned", "xla") runs the kernel with the table's config for a listed shape only;
    XLA for the rest, and on a CPU unless interpret=True."""
    cfg = GemvConfig(block_k=32, block_n=16, num_splits=2)
    table = tmp_path / "tuned_test.json"
    table.write_text(json.dumps({"entries": [
        {"kernel": "gemv", "K": 96, "N": 40, "M": 4, "dtype": "float32",
         "config": dataclasses.asdict(cfg)},
        {"kernel": "gemv", "K": 96, "N": 40, "M": 1, "dtype": "float32",
         "config": {"no_such_knob": 1}}]}))
    monkeypatch.setattr(common, "tuned_path", lambda op_dir: table)
    used = []

    def spy(x, w, **kw):
        used.append(kw["config"])
        return small_m_matmul_pallas(x, w, **kw)

    monkeypatch.setattr(api, "small_m_matmul_pallas", spy)
    x, w = operands(3, 96, 40, F32)
    tuned = ("tuned", "xla")
    np.testing.assert_allclose(small_m_matmul(x, w, impl=tuned, interpret=True),
                               small_m_matmul_reference(x, w), rtol=1e-5, atol=1e-5)
    assert used == [cfg]
    for args in [operands(1, 96, 40, F32),  # broken entry: skipped
                 operands(3, 96, 48, F32)]:  # no entry
        small_m_matmul(*args, impl=tuned, interpret=True)
    small_m_matmul(x, w, impl=tuned)  # CPU without interpret
    assert used == [cfg]


def test_moe_greedy_decode_identical_with_grouped_kernel(monkeypatch):
    """A tiny float32 MoE target (16 experts, top-2) decodes the same tokens with the grouped
    kernel (interpret mode: decode steps of 3 rows = 6 pairs take the few-pairs path) as with
    XLA's gather, and with matmul "tuned" (on a CPU: XLA throughout)."""
    calls = []

    def spy(*a, **kw):
        calls.append(a[2].shape)
        return grouped_small_m_matmul_pallas(*a, **kw)

    monkeypatch.setattr(api, "grouped_small_m_matmul_pallas", spy)
    cfg, params = tiny_target("moe", seed=4, vocab=16, num_experts=16)
    prompt, lens = random_prompts(np.random.default_rng(1), 3, 5, cfg.vocab_size)
    kw = dict(max_new=5, num_slots=16)
    want = ar_generate(params, prompt, lens, jax.random.key(0), cfg=cfg, **loop_args(**kw))
    for kernels in (PALLAS, Kernels(matmul=("tuned", "xla"))):
        got = ar_generate(params, prompt, lens, jax.random.key(0), cfg=cfg,
                          **loop_args(kernels=kernels, **kw))
        np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert (6,) in calls  # the kernel ran (traced) for the decode steps' pairs


SORTED_CASES = [
    # (group sizes [E], extra rows past their sum, K, N, config, input dtype, out dtype or None)
    ([0, 1, 17, 0, 40, 3], 0, 100, 72, SortedConfig(block_k=32, block_n=32, num_splits=1),
     F32, None),  # empty groups, 1 row, 17 and 40 rows across 16-row blocks, K and N tails
    ([0, 1, 17, 0, 40, 3], 0, 100, 72, SortedConfig(block_k=32, block_n=32, num_splits=3),
     BF16, F32),
    ([0, 0, 70, 0], 0, 64, 48, SortedConfig(block_k=32, block_n=32, num_splits=2), BF16,
     None),  # all rows in one expert: 70 > 64 rows, two row passes
    ([20, 0, 33, 5], 2, 96, 40, SortedConfig(block_k=32, block_n=16, row_blocks=1), F32,
     None),  # one row block per pass; 2 rows past the groups (zero); auto splits
    ([3, 5, 0, 9, 1, 0], 0, 160, 64, None, BF16, None),  # heuristic config, last expert empty
]


@pytest.mark.parametrize("sizes,extra,k,n,cfg,dtype,out_dtype", SORTED_CASES,
                         ids=lambda v: str(v)[:40])
def test_sorted_kernel_matches_ragged_dot(sizes, extra, k, n, cfg, dtype, out_dtype):
    rows = sum(sizes) + extra
    x, w = grouped_operands(rows, len(sizes), k, n, dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    y = grouped_matmul_sorted_pallas(x, w, group_sizes, out_dtype=out_dtype, config=cfg,
                                     interpret=True)
    ref = grouped_matmul_sorted_reference(x, w, group_sizes, out_dtype)
    assert y.shape == (rows, n) and y.dtype == ref.dtype
    assert np.all(np.isfinite(np.asarray(y, np.float32)))  # every row written
    assert rel_err(y, ref) <= TOL[jnp.dtype(out_dtype or dtype)]
    if extra:
        assert not np.any(np.asarray(y[sum(sizes):]))


def test_sorted_api_impls_and_fallback(monkeypatch):
    x, w = grouped_operands(40, 5, 96, 40, F32)
    sizes = jnp.asarray([7, 0, 20, 13, 0], jnp.int32)
    ref = grouped_matmul_sorted_reference(x, w, sizes)
    for impl in ("xla", "pallas", None):
        np.testing.assert_allclose(grouped_matmul_sorted(x, w, sizes, impl=impl, interpret=True),
                                   ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="unknown matmul impl"):
        grouped_matmul_sorted(x, w, sizes, impl="tuned")
    bad = SortedConfig(block_k=48)  # not a power of two: the kernel declines
    with pytest.raises(NotImplementedError, match="power of two"):
        grouped_matmul_sorted(x, w, sizes, impl="pallas", interpret=True, config=bad)
    np.testing.assert_allclose(grouped_matmul_sorted(x, w, sizes, interpret=True, config=bad),
                               ref, rtol=1e-5, atol=1e-4)

    forbid_kernel(monkeypatch, "grouped_matmul_sorted_pallas")
    np.testing.assert_allclose(grouped_matmul_sorted(x, w, sizes), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_rows,k,n", [(128, 2048, 768), (2048, 768, 2048)])
def test_sorted_lowers_for_h200(num_rows, k, n):
    """Qwen3-30B-A3B experts (gate/up at T=16 tree tokens, down at 256 tokens)."""
    from pallas_kernels.lowering_check import lower_for_gpu

    x, w = jnp.zeros((num_rows, k), BF16), jnp.zeros((128, k, n), BF16)
    sizes = jnp.zeros((128,), jnp.int32)
    text = lower_for_gpu(grouped_matmul_sorted_pallas, x, w, sizes)
    assert "__gpu$xla.gpu.triton" in text
    cfg = sorted_config(num_rows, 128, k, n, sms=132)
    assert (k // cfg.block_k) % cfg.num_splits == 0


def test_moe_many_pairs_with_sorted_kernel_matches_xla(monkeypatch):
    """layers.moe with 2 x 5 tokens at top-2 of 8 experts (20 pairs > E/2: the sorted path)
    equals its ragged_dot form with the expert-major kernel in interpret mode."""
    calls = []

    def spy(*a, **kw):
        calls.append(a[2].shape)
        return grouped_matmul_sorted_pallas(*a, **kw)

    monkeypatch.setattr(api, "grouped_matmul_sorted_pallas", spy)
    e, d, f = 8, 32, 24
    ks = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(ks[0], (2, 5, d), F32)
    router = jax.random.normal(ks[1], (d, e), F32)
    gate, up = (jax.random.normal(kk, (e, d, f), F32) / d**0.5 for kk in ks[2:4])
    down = jax.random.normal(ks[4], (e, f, d), F32) / f**0.5
    kw = dict(top_k=2, normalize=True)
    want = layers.moe(x, router, gate, up, down, kernels=Kernels(), **kw)
    got = layers.moe(x, router, gate, up, down, kernels=PALLAS, **kw)
    assert calls == [(e,)] * 3
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
