"""Attention kernels (interpret mode on CPU) against the pure-JAX reference, the compact mask,
and cross-lowering of every kernel for CUDA targets (no GPU needed).

Interpret mode costs ~1-3 s per new shape on CPU, so the grid is curated: every value of each
axis (T in {1, 5, 16, 37}, GQA ratio in {1, 3, 4, 8}, head dim in {64, 128}, causal /
all-ones / random ancestor masks, ragged prefix lengths incl. 0, split-K 1 or more,
float32 / bf16) appears in several combinations rather than in the full product.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.decode_attention.config import DecodeConfig
from pallas_kernels.decode_attention.reference import decode_attention_reference
from pallas_kernels.tree_attention import cache_attention
from pallas_kernels.tree_attention import mask as mask_lib
from pallas_kernels.tree_attention import api as tree_api
from pallas_kernels import common
from pallas_kernels.decode_attention.config import decode_config
from pallas_kernels.tree_attention.config import (MosaicConfig, PortableConfig, mosaic_config,
                                                  portable_config)
from pallas_kernels.tree_attention.hopper import cache_attention_hopper
from pallas_kernels.tree_attention.hopper import default_config as hopper_default_config
from pallas_kernels.tree_attention.portable import cache_attention_portable
from pallas_kernels.tree_attention.reference import cache_attention_reference

TOL = {jnp.dtype(jnp.float32): dict(atol=1e-4, rtol=1e-4),
       jnp.dtype(jnp.bfloat16): dict(atol=3e-2, rtol=3e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    t: int  # queries (block keys)
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    slots: int  # cache length S
    prefix: tuple  # prefix_len per batch element
    mask: str  # "causal" | "ones" | "tree"
    dtype: object = jnp.bfloat16
    splits: int | None = 1

    def __str__(self):
        d = "bf16" if self.dtype == jnp.bfloat16 else "f32"
        return (f"B{self.batch}-T{self.t}-K{self.kv_heads}-G{self.group}-H{self.head_dim}"
                f"-S{self.slots}-{self.mask}-{d}-ns{self.splits}")


def random_parents(rng, t):
    """parent[0] = -1 (root), parent[n] uniform in [0, n)."""
    return np.array([-1] + [int(rng.integers(0, n)) for n in range(1, t)])


def ancestor_matrix(parents):
    """bool [T, T]: m[n, j] iff j is n or an ancestor of n."""
    t = len(parents)
    m = np.eye(t, dtype=bool)
    for n in range(1, t):
        m[n] |= m[parents[n]]
    return m


def make_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.key(seed), 3)
    n = case.kv_heads * case.group
    q = jax.random.normal(ks[0], (case.batch, case.t, n, case.head_dim), case.dtype)
    k = jax.random.normal(ks[1], (case.batch, case.kv_heads, case.slots, case.head_dim), case.dtype)
    v = jax.random.normal(ks[2], (case.batch, case.kv_heads, case.slots, case.head_dim), case.dtype)
    prefix = jnp.array(case.prefix, jnp.int32)
    assert max(case.prefix) + case.t <= case.slots
    if case.mask == "causal":
        mask = None
    elif case.mask == "ones":
        mask = jnp.ones((case.batch, case.t, case.t), bool)
    else:
        mask = jnp.array(np.stack([ancestor_matrix(random_parents(rng, case.t))
                                   for _ in range(case.batch)]))
    return q, k, v, prefix, mask


def poison_beyond(cache, prefix, t, value):
    """Fills the never-visible slots >= prefix + T with `value`."""
    slots = jnp.arange(cache.shape[2])[None, None, :, None]
    return jnp.where(slots >= (prefix + t)[:, None, None, None], jnp.asarray(value, cache.dtype),
                     cache)


def check(out, q, k, v, prefix, mask):
    want = cache_attention_reference(q, k, v, prefix, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out32)), "non-finite output"
    np.testing.assert_allclose(out32, np.asarray(want.astype(jnp.float32)), **TOL[q.dtype])


# ---------------------------------------------------------------- compact mask
@pytest.mark.parametrize("t", [1, 5, 31, 32, 33, 64, 100, 256])
def test_packed_mask_matches_dense(t):
    rng = np.random.default_rng(t)
    dense = np.stack([ancestor_matrix(random_parents(rng, t)), rng.random((t, t)) < 0.5])
    packed = mask_lib.pack_block_mask(jnp.array(dense))
    assert packed.dtype == jnp.uint32 and packed.shape == (2, t, -(-t // 32))
    words = np.asarray(packed)
    for b in range(2):
        for i in range(t):
            for j in range(t):
                assert bool((int(words[b, i, j // 32]) >> (j % 32)) & 1) == dense[b, i, j]
    np.testing.assert_array_equal(np.asarray(mask_lib.unpack_block_mask(packed, t)), dense)
    # The packed form is accepted wherever a bool mask is, with identical results.
    ref_dense = mask_lib.as_dense(packed, t)
    np.testing.assert_array_equal(np.asarray(ref_dense), dense)


@pytest.mark.parametrize("t,group,block_rows", [(37, 3, 16), (16, 4, 64), (5, 8, 16), (64, 1, 32)])
def test_row_block_extent(t, group, block_rows):
    rng = np.random.default_rng(0)
    dense = np.stack([ancestor_matrix(random_parents(rng, t)), np.ones((t, t), bool)])
    nrb = -(-t * group // block_rows)
    ext = np.asarray(mask_lib.row_block_extent(mask_lib.pack_block_mask(jnp.array(dense)), t, group,
                                               block_rows, nrb))
    for b in range(2):
        for rb in range(nrb):
            rows = [r for r in range(rb * block_rows, (rb + 1) * block_rows) if r < t * group]
            want = max([j + 1 for r in rows for j in range(t) if dense[b, r // group, j]], default=0)
            assert ext[b, rb] == want


# ---------------------------------------------------------------- portable (Triton) kernel
PORTABLE_CASES = [
    # T=1 (decode through the general kernel), ragged incl. an empty prefix.
    Case(3, 1, 2, 4, 64, 96, (0, 41, 95), "causal", jnp.float32),
    Case(2, 1, 1, 8, 128, 64, (63, 7), "ones", jnp.bfloat16, splits=3),
    # T=5, not a multiple of anything.
    Case(2, 5, 2, 3, 64, 128, (0, 77), "tree", jnp.float32),
    Case(2, 5, 1, 1, 128, 96, (90, 13), "causal", jnp.bfloat16, splits=2),
    # T=16: the draft head's block (causal / all-ones) and a tree.
    Case(2, 16, 2, 4, 128, 128, (33, 112), "ones", jnp.bfloat16),
    Case(1, 16, 2, 8, 64, 160, (144,), "causal", jnp.float32, splits=4),
    Case(2, 16, 1, 3, 64, 96, (0, 80), "tree", jnp.bfloat16, splits=2),
    # T=37 > one 32-bit word, rows = 37 * G not a multiple of the block.
    Case(2, 37, 2, 3, 64, 160, (0, 123), "tree", jnp.float32),
    Case(1, 37, 1, 4, 128, 128, (50,), "tree", jnp.bfloat16, splits=3),
    Case(2, 37, 1, 1, 64, 100, (63, 0), "causal", jnp.bfloat16),
    Case(1, 37, 2, 8, 64, 64, (27,), "ones", jnp.float32, splits=2),
    # Prefill: prefix 0, causal.
    Case(1, 37, 2, 4, 128, 48, (0,), "causal", jnp.bfloat16),
]
PORTABLE_CONFIGS = [PortableConfig(block_q=16, block_k=32, block_kb=32),
                    PortableConfig(block_q=32, block_k=64, block_kb=64)]


@pytest.mark.parametrize("idx,case", list(enumerate(PORTABLE_CASES)), ids=lambda x: str(x))
def test_portable_kernel(idx, case):
    q, k, v, prefix, mask = make_inputs(case, seed=100 + idx)
    cfg = dataclasses.replace(PORTABLE_CONFIGS[idx % 2], num_splits=case.splits)
    # Slots past prefix + T must never be read: NaN there would poison the output.
    kp = poison_beyond(k, prefix, case.t, jnp.nan)
    vp = poison_beyond(v, prefix, case.t, jnp.nan)
    # Half the cases pass the mask pre-packed (uint32 words), half as bool.
    m = mask_lib.pack_block_mask(mask) if (mask is not None and idx % 2) else mask
    out = cache_attention_portable(q, kp, vp, prefix, m, config=cfg, interpret=True)
    check(out, q, k, v, prefix, mask)


def test_portable_auto_config_and_head_dim_80():
    """Default config (automatic splits), and a head dim that is not a power of two."""
    case = Case(2, 5, 2, 4, 80, 200, (0, 150), "tree", jnp.float32, splits=None)
    q, k, v, prefix, mask = make_inputs(case, seed=7)
    check(cache_attention_portable(q, k, v, prefix, mask, interpret=True), q, k, v, prefix, mask)


# ---------------------------------------------------------------- Hopper (Mosaic GPU) kernel
HOPPER_CASES = [
    Case(2, 37, 2, 3, 64, 256, (0, 219), "tree", splits=2),
    Case(2, 16, 1, 4, 128, 192, (64, 70), "tree", splits=3),
    Case(1, 5, 2, 8, 128, 128, (100,), "ones"),
    Case(2, 16, 1, 1, 64, 128, (5, 112), "causal"),
    Case(1, 1, 2, 4, 64, 128, (127,), "causal", splits=2),
    Case(1, 37, 1, 4, 128, 64, (0,), "causal"),  # prefill, S = one block
    # Splits share full and masked blocks evenly: one split holds both kinds, one is empty.
    Case(1, 37, 1, 4, 64, 512, (330,), "tree", splits=4),
    Case(2, 16, 2, 4, 128, 320, (0, 250), "causal", splits=4),
]


@pytest.mark.parametrize("idx,case", list(enumerate(HOPPER_CASES)), ids=lambda x: str(x))
def test_hopper_kernel(idx, case):
    q, k, v, prefix, mask = make_inputs(case, seed=200 + idx)
    # The Hopper kernel reads whole 64-slot blocks, so slots past prefix + T may be read
    # (never used): poison them with large finite garbage instead of NaN.
    kp = poison_beyond(k, prefix, case.t, 3e4)
    vp = poison_beyond(v, prefix, case.t, -3e4)
    # Even cases: the default config for the shape (block_k 128 for head dim 64), odd: 64 / 3.
    if idx % 2 == 0:
        cfg = dataclasses.replace(hopper_default_config(q, kp), num_splits=case.splits)
    else:
        cfg = MosaicConfig(block_k=64, stages=3, num_splits=case.splits)
    out = cache_attention_hopper(q, kp, vp, prefix, mask, config=cfg, interpret=True)
    check(out, q, k, v, prefix, mask)


def test_hopper_kernel_has_no_races():
    """Mosaic GPU interpret mode's happens-before race detector over TMA copies, barriers and
    wgmma reads of the multi-buffered K/V pipeline (2 stages: every buffer is reused)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    case = Case(2, 16, 1, 4, 64, 256, (70, 200), "ones", splits=2)
    q, k, v, prefix, mask = make_inputs(case, seed=250)
    cfg = MosaicConfig(block_k=64, stages=2, num_splits=2)
    out = cache_attention_hopper(q, k, v, prefix, mask, config=cfg,
                                 interpret=plgpu.InterpretGPUParams(detect_races=True))
    check(out, q, k, v, prefix, mask)
    assert not get_races().races_found


def test_hopper_rejects_unsupported_shapes():
    for dtype, h, s in [(jnp.float32, 64, 128), (jnp.bfloat16, 80, 128), (jnp.bfloat16, 64, 100)]:
        q = jnp.zeros((1, 4, 4, h), dtype)
        kc = jnp.zeros((1, 1, s, h), dtype)
        with pytest.raises(NotImplementedError):
            cache_attention_hopper(q, kc, kc, jnp.zeros((1,), jnp.int32), interpret=True)


# ---------------------------------------------------------------- split-K decode kernel
DECODE_CASES = [
    Case(3, 1, 2, 4, 128, 200, (0, 77, 199), "causal", jnp.bfloat16, splits=4),
    Case(2, 1, 1, 1, 64, 96, (95, 30), "causal", jnp.float32, splits=1),
    Case(1, 1, 2, 3, 64, 256, (255,), "causal", jnp.bfloat16, splits=5),
    Case(2, 1, 1, 8, 128, 128, (3, 64), "causal", jnp.float32, splits=None),
]


@pytest.mark.parametrize("idx,case", list(enumerate(DECODE_CASES)), ids=lambda x: str(x))
def test_decode_kernel(idx, case):
    q, k, v, prefix, _ = make_inputs(case, seed=300 + idx)
    kp = poison_beyond(k, prefix, 1, jnp.nan)
    vp = poison_beyond(v, prefix, 1, jnp.nan)
    cfg = DecodeConfig(block_k=32, num_splits=case.splits)
    out = decode_attention(q, kp, vp, prefix, impl="splitk", config=cfg, interpret=True)
    check(out, q, k, v, prefix, None)


def test_decode_rejects_t_above_one():
    q = jnp.zeros((1, 2, 4, 64))
    kc = jnp.zeros((1, 1, 64, 64))
    with pytest.raises(NotImplementedError):
        decode_attention(q, kc, kc, jnp.zeros((1,), jnp.int32), impl="splitk", interpret=True)


# ---------------------------------------------------------------- configs
def test_auto_num_splits_counts_resident_ctas():
    # 8 programs on 132 SMs: twice the CTA slots, capped by the blocks of the cache.
    assert common.auto_num_splits(8, 32768, 64, sms=132) == 33
    assert common.auto_num_splits(8, 32768, 64, sms=132, ctas=2) == 64  # max_splits
    assert common.auto_num_splits(8, 1024, 64, sms=132, ctas=2) == 8  # 2 blocks per split
    assert common.auto_num_splits(200, 32768, 64, sms=132) == 1
    assert common.ctas_per_sm(2 * 1024) == 4 and common.ctas_per_sm(150 * 1024) == 1


def test_tuned_table_lookup_and_fallback(tmp_path, monkeypatch):
    import json

    table = tmp_path / "tuned_test.json"
    entry = dict(kernel="hopper", batch=1, T=16, G=4, H=128, S=32768, dtype="bfloat16",
                 config=dict(block_k=64, stages=2, num_splits=40))
    bad = dict(entry, S=8192, config=dict(block_k=64, no_such_knob=1))  # skipped
    dec = dict(kernel="decode", batch=8, T=1, G=4, H=128, S=8192, dtype="bfloat16",
               config=dict(block_k=128, num_warps=8))
    table.write_text(json.dumps({"entries": [entry, bad, dec]}))
    monkeypatch.setattr(common, "tuned_path", lambda op_dir: table)
    kw = dict(batch=1, num_queries=16, dtype=jnp.bfloat16)
    tuned = MosaicConfig(block_k=64, stages=2, num_splits=40)
    heuristic = mosaic_config(64, 128)
    assert tuned != heuristic
    assert mosaic_config(64, 128, kv_len=32768, **kw) == tuned
    assert mosaic_config(64, 128, kv_len=20000, **kw) == tuned  # nearest S within 2x
    assert mosaic_config(64, 128, kv_len=8192, **kw) == heuristic  # only the bad entry near
    assert mosaic_config(60, 128, kv_len=32768, **dict(kw, num_queries=15)) == tuned  # T -> 16
    assert mosaic_config(128, 128, kv_len=32768, **dict(kw, num_queries=32)) == heuristic
    assert mosaic_config(64, 128, kv_len=32768, **dict(kw, dtype=jnp.float16)) == heuristic
    assert portable_config(64, 128, kv_len=32768, **kw) == portable_config(64, 128)
    assert decode_config(4, 128, batch=5, kv_len=8192, dtype=jnp.bfloat16) == DecodeConfig(
        block_k=128, num_warps=8)
    assert decode_config(4, 128, batch=1, kv_len=8192, dtype=jnp.bfloat16) == decode_config(4, 128)
    # The Hopper kernel's default: the table's entry, with block_k 64 where S needs it.
    table.write_text(json.dumps({"entries": [dict(entry, S=256, T=4, G=2, H=64,
                                                  config=dict(block_k=128, stages=3))]}))
    common.load_tuned.cache_clear()
    q = jnp.zeros((1, 4, 4, 64), jnp.bfloat16)
    kc = jnp.zeros((1, 2, 256, 64), jnp.bfloat16)
    assert hopper_default_config(q, kc) == MosaicConfig(block_k=128, stages=3)
    assert hopper_default_config(q, kc[:, :, :192]) == MosaicConfig(block_k=64, stages=3)
    table.unlink()  # no file: heuristics
    assert hopper_default_config(q, kc) == mosaic_config(8, 64)


def test_tune_script_candidates_and_tables(tmp_path):
    """bench/tune_attention.py: <= 8 distinct configs per kernel, the heuristic first; its
    tables are read back by the loader (winners only when > 3% faster than the heuristic)."""
    import json
    from pathlib import Path

    from bench import tune_attention as ta
    for kernel, t in [("portable", 256), ("hopper", 16), ("decode", 1)]:
        cands = ta.candidates(kernel, 1, t, 32768, ta.HEADS, False)
        assert 4 <= len(cands) <= 8 and cands[0][0] == "heuristic"
        assert len({c for _, c in cands}) == len(cands)
    tuned = dict(block_k=64, stages=2, num_splits=64, pv_via_smem=False)

    def shape(t, us):
        cands = [dict(kernel="hopper", label="heuristic", config={}, us=10.0),
                 dict(kernel="hopper", label="bk64_st2", config=tuned, us=us),
                 dict(kernel="baseline", label="xla_ref", config=None, us=5.0)]
        return dict(name="x", op="verify", B=1, T=t, S=32768, G=4, H=128, floor_us=1.0,
                    compute_us=1.0, candidates=cands)

    results = dict(device="test", jax="0", shapes=[shape(16, 8.0), shape(64, 9.9)])
    (path,) = ta.write_tables(results, tmp_path)
    assert Path(path) == tmp_path / "tree_attention" / "tuned_cpu.json"
    assert len(json.loads(Path(path).read_text())["entries"]) == 1  # T=64: within 3%
    kw = dict(kernel="hopper", batch=1, group=4, head_dim=128, kv_len=32768, dtype=jnp.bfloat16)
    assert common.tuned_config(path, MosaicConfig, t=16, **kw) == MosaicConfig(**tuned)
    assert common.tuned_config(path, MosaicConfig, t=64, **kw) is None


# ---------------------------------------------------------------- dispatcher
def served(monkeypatch) -> list[str]:
    """The names of the cache-attention implementations that served, call after call."""
    ran = []
    for name, fn in list(tree_api.IMPLEMENTATIONS.items()):
        def spy(*args, _fn=fn, _name=name, **kw):
            out = _fn(*args, **kw)
            ran.append(_name)
            return out
        monkeypatch.setitem(tree_api.IMPLEMENTATIONS, name, spy)
    return ran


def test_api_default_list_and_forced(monkeypatch):
    ran = served(monkeypatch)
    case = Case(2, 5, 2, 4, 64, 128, (10, 0), "tree", jnp.bfloat16)
    q, k, v, prefix, mask = make_inputs(case, seed=400)
    check(cache_attention(q, k, v, prefix, mask), q, k, v, prefix, mask)
    assert ran[-1] == "reference"  # CPU without interpret: the XLA reference
    check(cache_attention(q, k, v, prefix, mask, impl="reference"), q, k, v, prefix, mask)
    # Interpret mode on CPU walks the GPU chain (Hopper kernel first for T > 1).
    check(cache_attention(q, k, v, prefix, mask, interpret=True), q, k, v, prefix, mask)
    assert ran[-1] == "hopper"
    # float32 is not served by the Hopper kernel: the list falls back to the portable one.
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    check(cache_attention(q32, k32, v32, prefix, mask, interpret=True),
          q32, k32, v32, prefix, mask)
    assert ran[-1] == "portable"
    with pytest.raises(NotImplementedError):
        cache_attention(q32, k32, v32, prefix, mask, impl="hopper", interpret=True)
    # A list is tried in order.
    check(cache_attention(q32, k32, v32, prefix, mask, impl=("hopper", "reference"),
                          interpret=True), q32, k32, v32, prefix, mask)
    assert ran[-1] == "reference"
    # T = 1 goes to the split-K decode kernel.
    q1 = q[:, :1]
    check(cache_attention(q1, k, v, prefix, None, interpret=True), q1, k, v, prefix, None)
    assert ran[-1] == "decode"
    with pytest.raises(ValueError, match="choose from decode, hopper, portable, reference"):
        cache_attention(q, k, v, prefix, mask, impl="nope")


@pytest.mark.parametrize("idx,case", list(enumerate(DECODE_CASES)), ids=lambda x: str(x))
def test_decode_api_kernel_against_its_reference(idx, case):
    """decode_attention's implementations agree: the split-K kernel (interpret mode) and the
    pure-JAX reference, which the default list runs on a CPU."""
    q, k, v, prefix, _ = make_inputs(case, seed=500 + idx)
    want = decode_attention_reference(q, k, v, prefix)
    check(want, q, k, v, prefix, None)  # the reference is cache attention at T = 1
    got = decode_attention(q, k, v, prefix, impl="splitk", interpret=True)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)),
                               np.asarray(want.astype(jnp.float32)), **TOL[q.dtype])
    np.testing.assert_array_equal(np.asarray(decode_attention(q, k, v, prefix)),
                                  np.asarray(want))
    with pytest.raises(NotImplementedError, match="needs a GPU"):
        decode_attention(q, k, v, prefix, impl="splitk")


# ---------------------------------------------------------------- lowering for CUDA, no GPU
LOWER_SHAPES = [
    # (B, T, K, G, H, S, mask)
    (1, 64, 8, 4, 128, 2048, "tree"),
    (2, 16, 8, 4, 128, 4096, "causal"),
    (1, 37, 2, 3, 64, 512, "ones"),
]


@pytest.mark.parametrize("shape", LOWER_SHAPES, ids=str)
@pytest.mark.parametrize("kernel,device_kind", [
    ("portable", "NVIDIA H200"), ("portable", "NVIDIA B200"), ("hopper", "NVIDIA H200")])
def test_lowers_for_gpu(shape, kernel, device_kind):
    """The Pallas -> Triton / Mosaic GPU lowering (incl. Mosaic's layout inference) runs on
    CPU for an abstract GPU; only the final cubin compilation needs the device."""
    from pallas_kernels.lowering_check import lower_for_gpu

    b, t, kh, g, h, s, mask_kind = shape
    q = jnp.zeros((b, t, kh * g, h), jnp.bfloat16)
    kc = jnp.zeros((b, kh, s, h), jnp.bfloat16)
    mask = None if mask_kind == "causal" else jnp.ones((b, t, t), bool)
    fn = cache_attention_portable if kernel == "portable" else cache_attention_hopper
    text = lower_for_gpu(fn, q, kc, kc, jnp.zeros((b,), jnp.int32), mask, device_kind=device_kind)
    assert "custom_call" in text


@pytest.mark.parametrize("batch,slots", [(1, 32768), (8, 4096)])
def test_decode_lowers_for_gpu(batch, slots):
    from pallas_kernels.decode_attention.kernel import decode_attention as splitk_kernel
    from pallas_kernels.lowering_check import lower_for_gpu

    q = jnp.zeros((batch, 1, 32, 128), jnp.bfloat16)
    kc = jnp.zeros((batch, 8, slots, 128), jnp.bfloat16)
    text = lower_for_gpu(splitk_kernel, q, kc, kc, jnp.zeros((batch,), jnp.int32))
    assert "custom_call" in text
