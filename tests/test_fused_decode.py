"""The fused decode kernel (q/k RMSNorm + RoPE + cache write + split-K attention; interpret
mode on CPU, the compiled kernel on a GPU) against the unfused sequence of the model:
layers.rms_norm, layers.rope, cache.write_slots and the reference cache attention (T = 1).

Standalone in interpret mode, the caches must come out bit for bit as the unfused write
leaves them: stricter than losslessness needs (a last-bit difference is harmless, the
attention kernels already sum in their own orders), but it pins the norm and RoPE math to the
model's op for op. Both sides run under jit, as in the model: XLA folds constants (RoPE's
inverse frequencies) and contracts a*b - c*d into FMAs inside fusions, so op-by-op (eager)
results can differ in the last bit. Compiled on a GPU, the new key differed from XLA's own
norm + RoPE fusion in its last bits (seen on the H200), so there it may be off by an ulp;
every other slot must still be bitwise-equal.

Interpret mode costs ~1-3 s per shape, so the grid is curated: batch 1 / 2 / 3 with ragged
write_start incl. 0 and S - 1, GQA ratio 1 / 3 / 4 / 8, head dim 64 / 128 (and 80: padded
RoPE halves), float32 / bf16, with and without q/k norm, 1 or several splits (and automatic),
S below one block.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.model import target
from jetspec_jax.model.cache import write_slots
from jetspec_jax.model.kernels import GPU_ATTENTION, Kernels, choose
from jetspec_jax.model.layers import rms_norm, rope
from pallas_kernels.decode_attention import fused_decode_attention, rope_cos_sin
from pallas_kernels.decode_attention.config import DecodeConfig
from pallas_kernels.tree_attention.reference import cache_attention_reference

TOL = {jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
       jnp.dtype(jnp.bfloat16): dict(atol=3e-2, rtol=3e-2)}
# The new key on a GPU: within a unit in the last place (bf16 values of |x| < 4: 2^-6).
KEY_TOL = {jnp.dtype(jnp.float32): dict(atol=1e-6, rtol=2e-7),
           jnp.dtype(jnp.bfloat16): dict(atol=2 ** -6, rtol=2 ** -8)}
EPS = 1e-6
# On a GPU the same tests check the compiled kernel against XLA's unfused path.
INTERPRET = jax.default_backend() != "gpu"
# The model's kernels for the kernel: other calls take the reference on a CPU (not the GPU
# chain in interpret mode), the GPU chain on a GPU.
FUSED = Kernels(("fused_decode", "reference") if INTERPRET else GPU_ATTENTION,
                interpret=INTERPRET)


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    slots: int  # cache length S
    write_start: tuple  # per batch element
    dtype: object
    norm: bool  # q/k RMSNorm (Qwen3) or none (Llama)
    splits: int | None  # None: automatic
    block_k: int

    def __str__(self):
        d = "bf16" if self.dtype == jnp.bfloat16 else "f32"
        return (f"B{self.batch}-K{self.kv_heads}-G{self.group}-H{self.head_dim}-S{self.slots}"
                f"-{d}-{'norm' if self.norm else 'nonorm'}-ns{self.splits}-bk{self.block_k}")


CASES = [
    Case(1, 2, 1, 64, 40, (39,), jnp.float32, True, 1, 64),  # write at S - 1; S < block_k
    Case(3, 2, 4, 128, 96, (0, 41, 95), jnp.bfloat16, True, 3, 32),
    Case(3, 1, 3, 64, 72, (71, 0, 17), jnp.float32, False, 4, 16),
    Case(1, 2, 8, 128, 200, (130,), jnp.bfloat16, False, 1, 64),
    Case(3, 2, 8, 64, 64, (5, 63, 0), jnp.bfloat16, True, 2, 16),
    Case(1, 1, 4, 128, 160, (0,), jnp.float32, True, 5, 32),  # the new token alone
    Case(3, 1, 1, 128, 50, (49, 24, 1), jnp.bfloat16, False, None, 64),
    Case(2, 2, 3, 128, 120, (119, 64), jnp.float32, True, 3, 32),
    Case(2, 1, 4, 80, 48, (47, 10), jnp.float32, True, 2, 16),  # H / 2 = 40: padded halves
]


def make_inputs(case: Case, seed: int):
    ks = jax.random.split(jax.random.key(seed), 7)
    b, kh, h, dt = case.batch, case.kv_heads, case.head_dim, case.dtype
    q = jax.random.normal(ks[0], (b, 1, kh * case.group, h), dt)
    k = jax.random.normal(ks[1], (b, 1, kh, h), dt)
    v = jax.random.normal(ks[2], (b, 1, kh, h), dt)
    k_cache = jax.random.normal(ks[3], (b, kh, case.slots, h), dt)
    v_cache = jax.random.normal(ks[4], (b, kh, case.slots, h), dt)
    norms = (None, None)
    if case.norm:
        norms = tuple((1 + 0.2 * jax.random.normal(kk, (h,))).astype(dt) for kk in ks[5:])
    write_start = jnp.array(case.write_start, jnp.int32)
    positions = write_start + 3 * jnp.arange(b, dtype=jnp.int32) + 2  # not the slots
    return q, k, v, k_cache, v_cache, write_start, positions, norms


@functools.partial(jax.jit, static_argnames=("theta",))
def unfused_step(q, k, v, k_cache, v_cache, write_start, positions, q_norm, k_norm, *, theta):
    """The model's attention_block between the projections and the output projection."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, EPS), rms_norm(k, k_norm, EPS)
    q, k = rope(q, positions[:, None], theta), rope(k, positions[:, None], theta)
    k_cache, v_cache = write_slots(k_cache, k, write_start), write_slots(v_cache, v, write_start)
    return cache_attention_reference(q, k_cache, v_cache, write_start, None), k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("theta", "config"))
def fused_step(q, k, v, k_cache, v_cache, write_start, positions, q_norm, k_norm, *, theta,
               config):
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta)
    return fused_decode_attention(q, k, v, k_cache, v_cache, write_start, cos, sin, q_norm,
                                  k_norm, eps=EPS, config=config, interpret=INTERPRET)


def poison_from(cache, first, value=jnp.nan):
    """Slots >= first[b] set to value."""
    slots = jnp.arange(cache.shape[2])[None, None, :, None]
    return jnp.where(slots >= first[:, None, None, None], jnp.asarray(value, cache.dtype), cache)


def assert_bitwise_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    diff = got.view(bits) != want.view(bits)
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {np.argwhere(diff)[0]}"


@pytest.mark.parametrize("idx,case", list(enumerate(CASES)), ids=lambda x: str(x))
def test_fused_matches_unfused(idx, case):
    q, k, v, kc, vc, ws, pos, (qn, kn) = make_inputs(case, seed=400 + idx)
    theta = 1e6 if idx % 2 else 1e4
    want, want_k, want_v = unfused_step(q, k, v, kc, vc, ws, pos, qn, kn, theta=theta)
    # Slot write_start and beyond must never be read from the cache: NaN there would poison
    # the output (in interpret mode the writer runs after every reader of its (b, h)).
    kp, vp = poison_from(kc, ws), poison_from(vc, ws)
    cfg = DecodeConfig(block_k=case.block_k, num_splits=case.splits)
    out, got_k, got_v = fused_step(q, k, v, kp, vp, ws, pos, qn, kn, theta=theta, config=cfg)

    # Every slot: the new token at write_start, the rest (poison included) untouched.
    want_k, want_v = poison_from(want_k, ws + 1), poison_from(want_v, ws + 1)
    assert_bitwise_equal(got_v, want_v)
    if INTERPRET:
        assert_bitwise_equal(got_k, want_k)
    else:  # the new key: XLA's norm and RoPE fusions round their own way (rsqrt, FMA)
        written = (jnp.arange(case.slots) == ws[:, None])[:, None, :, None]
        assert_bitwise_equal(jnp.where(written, 0, got_k), jnp.where(written, 0, want_k))
        pick = lambda c: np.asarray(c[jnp.arange(case.batch), :, ws].astype(jnp.float32))
        np.testing.assert_allclose(pick(got_k), pick(want_k), **KEY_TOL[q.dtype])
    assert out.shape == q.shape and out.dtype == q.dtype
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out32)), "non-finite output"
    np.testing.assert_allclose(out32, np.asarray(want.astype(jnp.float32)), **TOL[q.dtype])


def _shapes(b=1, t=1, n=4, kh=2, h=64, s=32, dtype=jnp.float32, cache_dtype=None, half=None):
    q = jnp.zeros((b, t, n, h), dtype)
    kv = jnp.zeros((b, 1, kh, h), dtype)
    cache = jnp.zeros((b, kh, s, h), cache_dtype or dtype)
    cs = jnp.zeros((b, h // 2 if half is None else half), jnp.float32)
    return q, kv, kv, cache, cache, jnp.zeros((b,), jnp.int32), cs, cs


@pytest.mark.parametrize("why,kwargs", [
    ("T == 1", dict(t=2)),
    ("not a multiple", dict(n=6, kh=4)),
    ("> 256 or odd", dict(h=512)),
    ("> 256 or odd", dict(h=63)),
    ("dtype mismatch", dict(dtype=jnp.bfloat16, cache_dtype=jnp.float32)),
    ("cos / sin", dict(half=64)),
])
def test_rejects_what_it_cannot_serve(why, kwargs):
    with pytest.raises(NotImplementedError, match=why):
        fused_decode_attention(*_shapes(**kwargs), interpret=True)


def test_rope_cos_sin_matches_layers_rope():
    """rope(x) == x1 * cos - x2 * sin | x2 * cos + x1 * sin with the helper's angles."""
    h, pos = 64, jnp.array([0, 7, 4095], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (3, 1, 2, h))

    @jax.jit
    def by_helper(x, pos):
        cos, sin = (a[:, None, None, :] for a in rope_cos_sin(pos, h, 1e6))
        x1, x2 = x[..., : h // 2], x[..., h // 2:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    want = jax.jit(rope, static_argnums=2)(x, pos[:, None], 1e6)
    assert_bitwise_equal(by_helper(x, pos), want)


@pytest.mark.parametrize("h,norm", [(128, True), (80, False)])
def test_fused_lowers_for_gpu_with_aliased_caches(h, norm):
    """The Pallas -> Triton lowering (CPU, abstract H200) of the masked stores at a dynamic row
    under pl.when; the caches leave the custom call aliased to its operands."""
    from pallas_kernels.lowering_check import lower_for_gpu

    b, kh, g, s = 2, 8, 4, 4096
    q, k, v, kc, vc, ws, cos, sin = _shapes(b=b, n=kh * g, kh=kh, h=h, s=s, dtype=jnp.bfloat16)
    w = jnp.ones((h,), jnp.bfloat16) if norm else None
    text = lower_for_gpu(fused_decode_attention, q, k, v, kc, vc, ws, cos, sin, w, w)
    assert "custom_call" in text and text.count("stablehlo.output_operand_alias<") == 2


@pytest.mark.parametrize("kind", ["dense", "llama"])
def test_model_decode_with_fused_kernel_matches_reference(kind):
    """Through the model (float32; Qwen3 with q/k norms, Llama without): one decode step
    with the fused kernel (compiled on a GPU, interpreted elsewhere) writes every layer's cache
    as the reference does and gives its hidden states, to float32 rounding: inside one jitted
    model XLA fuses the unfused norm and RoPE its own way (multiply-add contraction), so with
    q/k norms even layer 0's new key can differ in the last bit, and later layers carry the
    attention kernel's summation order. Autoregressive decoding gives the reference's
    tokens."""
    from jetspec_jax.decode.autoregressive import ar_generate, prefill
    from helpers import loop_args, random_prompts, tiny_target

    cfg, params = tiny_target(kind, seed=3, vocab=32)
    prompt, lens = random_prompts(np.random.default_rng(4), 2, 5, 32)
    cache = target.allocate_cache(cfg, 2, 16, jnp.float32)
    _, cache, _ = prefill(params, cfg, prompt, lens, cache)
    token = jnp.array([[7], [11]], jnp.int32)
    impls = (Kernels(), FUSED)
    step = {impl: jax.jit(lambda c, impl=impl: target.forward(
                params, cfg, token, lens[:, None], c, lens, kernels=impl)[:2])(cache)
            for impl in impls}
    (want_h, want_c), (got_h, got_c) = step[Kernels()], step[FUSED]
    assert_bitwise_equal(got_c.v[0], want_c.v[0])  # a copy: no rounding on the way
    for got, want in zip(got_c.k + got_c.v, want_c.k + want_c.v):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), atol=1e-5, rtol=1e-5)

    outs = {impl: ar_generate(params, prompt, lens, jax.random.key(0), cfg=cfg,
                              **loop_args(max_new=6, num_slots=16, kernels=impl,
                                          cache_dtype=jnp.float32))
            for impl in impls}
    np.testing.assert_array_equal(np.asarray(outs[FUSED].tokens),
                                  np.asarray(outs[Kernels()].tokens))


def test_auto_runs_fused_kernel_on_one_gpu_only():
    """"auto" resolves once: the fused kernel on a GPU, the reference on a CPU or a mesh of
    several devices; the matmul kernels for MoE models, XLA for dense ones."""
    assert choose(backend="gpu") == Kernels(GPU_ATTENTION)
    assert GPU_ATTENTION == ("fused_decode", "decode", "hopper", "portable", "reference")
    assert choose("fused_decode", backend="gpu") == Kernels(GPU_ATTENTION)
    assert choose(backend="gpu", sharded=True) == Kernels("reference")
    assert choose("portable", backend="gpu", sharded=True) == Kernels("portable")
    assert choose("decode,reference", backend="gpu") == Kernels(("decode", "reference"))
    assert choose(backend="cpu") == Kernels("reference")
    assert choose(backend="cpu", moe=True) == Kernels("reference", ("pallas", "xla"))
    assert choose(matmul="tuned", backend="cpu", moe=True).matmul == ("tuned", "xla")
    # the fused kernel is the target's step, not a cache attention: the rest of the list is
    assert FUSED.cache_attention() == FUSED.attention[1:]
    assert Kernels("portable", interpret=True).cache_attention() == ("portable",)
    with pytest.raises(ValueError, match="fused_decode serves one-token steps only"):
        Kernels("fused_decode")
    with pytest.raises(ValueError, match="unknown matmul kernel 'cublas'; choose from auto, xla"):
        choose(matmul="cublas")
