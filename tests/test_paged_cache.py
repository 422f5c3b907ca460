"""Paged KV caches: writes, reads, compaction and attention (the references and the Pallas
kernels in interpret mode) through the block table equal the dense cache's; autoregressive
and speculative decoding on a paged cache (blocks scattered over one shared pool, grown and
freed between streamed rounds, laid out by `api.generate`) equal the dense outputs token for
token; the block allocator's bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import PartitionSpec

from helpers import loop_args, random_prompts, tiny_head, tiny_target
from jetspec_jax import api
from jetspec_jax.decode import streaming
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import TreeSpec, slots_ahead, spec_generate, working_slots
from jetspec_jax.model.blocks import BlockAllocator, OutOfBlocks
from jetspec_jax.model.cache import (KVCache, Paging, compact, gather_slots, retable,
                                     write_slots)
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.model.sharding import state_specs
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.decode_attention.config import DecodeConfig
from pallas_kernels.paged import NULL_BLOCK, Pages, logical
from pallas_kernels.tree_attention import cache_attention
from pallas_kernels.tree_attention.config import PortableConfig

B, K, H = 3, 2, 4


def paged_copy(dense, table, num_blocks, rng):
    """dense [B, K, S, H] laid out through table in a pool of num_blocks blocks; the blocks of
    no row (NULL_BLOCK too) hold noise, so a read of them shows."""
    b, k, s, h = dense.shape
    m = table.shape[1]
    pool = rng.normal(size=(num_blocks, k, s // m, h)).astype(np.float32)
    pool[table] = dense.reshape(b, k, m, s // m, h).transpose(0, 2, 1, 3, 4)
    return Pages(jnp.asarray(pool), jnp.asarray(table))


def random_table(rng, batch, max_blocks, num_blocks):
    """Every row's blocks distinct and scattered over the pool, NULL_BLOCK in none."""
    return (1 + rng.permutation(num_blocks - 1)[:batch * max_blocks]).reshape(batch, max_blocks)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), block_size=st.sampled_from([1, 2, 4]),
       max_blocks=st.integers(2, 3))
def test_write_gather_compact_through_the_table_equal_dense(seed, block_size, max_blocks):
    rng = np.random.default_rng(seed)
    s = block_size * max_blocks
    num_blocks = B * max_blocks + 3  # spare blocks no row holds
    table = random_table(rng, B, max_blocks, num_blocks)
    k, v = (rng.normal(size=(B, K, s, H)).astype(np.float32) for _ in range(2))
    pk, pv = paged_copy(k, table, num_blocks, rng), paged_copy(v, table, num_blocks, rng)
    np.testing.assert_array_equal(logical(pk), k)
    spare = np.setdiff1d(np.arange(num_blocks), table)

    t = int(rng.integers(1, s + 1))
    start = jnp.asarray(rng.integers(0, s - t + 1, size=B), jnp.int32)
    new = jnp.asarray(rng.normal(size=(B, t, K, H)), jnp.float32)
    written = write_slots(pk, new, start)
    np.testing.assert_array_equal(logical(written), write_slots(jnp.asarray(k), new, start))
    np.testing.assert_array_equal(written.pool[spare], pk.pool[spare])  # no stray writes

    slots = jnp.asarray(rng.integers(0, s, size=(B, t)), jnp.int32)
    np.testing.assert_array_equal(gather_slots(pk, slots), gather_slots(jnp.asarray(k), slots))

    lengths = jnp.asarray(rng.integers(0, s - t + 1, size=B), jnp.int32)
    count = jnp.asarray(rng.integers(0, t + 1, size=B), jnp.int32)
    dense = compact(KVCache(k=[jnp.asarray(k)], v=[jnp.asarray(v)], lengths=lengths), slots,
                    lengths, count)
    paged = compact(KVCache(k=[pk.pool], v=[pv.pool], lengths=lengths, table=pk.table), slots,
                    lengths, count)
    for d, p in zip(dense.layer(0), paged.layer(0)):
        np.testing.assert_array_equal(logical(p), d)
    np.testing.assert_array_equal(paged.lengths, dense.lengths)
    np.testing.assert_array_equal(paged.table, table)


def paged_inputs(seed, block_size, max_blocks, queries, poison=np.nan):
    """q [B, T, N, H], dense caches, the same paged in a shared pool with poison in the
    blocks of no row and in the slots past each row's prefix + T, and the prefix lengths."""
    rng = np.random.default_rng(seed)
    s, num_blocks = block_size * max_blocks, B * max_blocks + 2
    table = random_table(rng, B, max_blocks, num_blocks)
    prefix = np.array([0, (s - queries) // 2, s - queries])
    past = np.arange(s)[None, None, :, None] >= (prefix + queries)[:, None, None, None]
    dense = [rng.normal(size=(B, K, s, H)).astype(np.float32) for _ in range(2)]
    pages = [paged_copy(np.where(past, poison, x), table, num_blocks, rng) for x in dense]
    spare = np.setdiff1d(np.arange(num_blocks), table)
    pages = [Pages(p.pool.at[spare].set(poison), p.table) for p in pages]
    q = jnp.asarray(rng.normal(size=(B, queries, 2 * K, H)), jnp.float32)
    return q, [jnp.asarray(x) for x in dense], pages, jnp.asarray(prefix, jnp.int32)


@pytest.mark.parametrize("block_size,max_blocks,queries,tree,splits", [
    (4, 3, 3, True, None), (16, 4, 5, True, 2), (16, 4, 40, False, 1)])
def test_tree_attention_reads_blocks_through_the_table(block_size, max_blocks, queries, tree,
                                                       splits):
    """The reference and the portable kernel (interpret mode) on a paged cache equal the
    reference on the dense one (tree mask or causal; block keys crossing blocks); the portable
    kernel never reads the NaN-poisoned blocks of no row or slots past the block keys; the
    Hopper kernel declines."""
    q, dense, pages, prefix = paged_inputs(block_size, block_size, max_blocks, queries)
    mask = None
    if tree:
        mask = jnp.asarray(np.random.default_rng(1).random((B, queries, queries)) < 0.5)
        mask = jnp.tril(mask | jnp.eye(queries, dtype=bool))
    want = cache_attention(q, *dense, prefix, mask, impl="reference")
    clean = [Pages(jnp.nan_to_num(p.pool), p.table) for p in pages]  # the reference's 0 * NaN
    np.testing.assert_allclose(cache_attention(q, *clean, prefix, mask, impl="reference"),
                               want, rtol=1e-6, atol=1e-6)
    got = cache_attention(q, *pages, prefix, mask, impl=("hopper", "portable"), interpret=True,
                          config=PortableConfig(block_q=16, block_k=16, num_splits=splits))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="paged"):
        cache_attention(q, *pages, prefix, mask, impl="hopper", interpret=True)


@pytest.mark.parametrize("block_size,max_blocks,block_k,splits", [
    (16, 5, 16, 1), (16, 5, 16, 3), (32, 3, 16, None), (8, 4, 64, 2)])
def test_decode_kernel_reads_blocks_through_the_table(block_size, max_blocks, block_k, splits):
    """The split-K kernel (interpret mode) on a paged cache equals the reference on the dense
    one; it never reads the NaN-poisoned blocks of no row or slots past the prefix."""
    q, dense, pages, prefix = paged_inputs(block_size, block_size, max_blocks, 1)
    want = decode_attention(q, *dense, prefix, impl="reference")
    got = decode_attention(q, *pages, prefix, impl="splitk", interpret=True,
                           config=DecodeConfig(block_k=block_k, num_splits=splits))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("queries", [1, 64])
def test_paged_kernels_lower_for_gpu(queries):
    """The split-K decode kernel (one query) and the portable tree kernel (a tree mask) on a
    paged bfloat16 cache lower for an H200."""
    from pallas_kernels.decode_attention.kernel import decode_attention as splitk_kernel
    from pallas_kernels.lowering_check import lower_for_gpu
    from pallas_kernels.tree_attention.portable import cache_attention_portable

    q = jnp.zeros((8, queries, 32, 128), jnp.bfloat16)
    pages = Pages(jnp.zeros((600, 8, 64, 128), jnp.bfloat16), jnp.zeros((8, 64), jnp.int32))
    args = (q, pages, pages, jnp.zeros((8,), jnp.int32))
    text = lower_for_gpu(splitk_kernel, *args) if queries == 1 else \
        lower_for_gpu(cache_attention_portable, *args, jnp.ones((8, queries, queries), bool))
    assert "custom_call" in text


# One tiny target and head, three ragged prompts; the pool is smaller than the dense caches.
MAX_NEW, SLOTS, BLOCK = 16, 64, 4
SPEC = TreeSpec(8, 3, "accum_logp", ngram=3)  # the text repeats: chains get accepted
EXTRA = working_slots(SPEC.budget, 4)
PAGING = Paging(BLOCK, 1 + B * SLOTS // BLOCK * 2 // 3)


def model():
    tcfg, tp = tiny_target("dense", seed=1, vocab=64)  # wide: argmax turns on small changes
    dcfg, dp = tiny_head(tcfg, seed=7, block_size=4)
    prompt, lens = random_prompts(np.random.default_rng(3), B, 7, tcfg.vocab_size)
    return tcfg, tp, dcfg, dp, prompt, lens


def scattered_table(lens, extra, seed):
    """Each row's blocks for prompt + MAX_NEW + extra slots, taken a block at a time by rows
    in a random order, so they interleave in the pool."""
    alloc, rng = BlockAllocator(PAGING), np.random.default_rng(seed)
    need = [int(n) + MAX_NEW + extra for n in lens]
    while short := [b for b in range(B) if len(alloc.blocks(b)) * BLOCK < need[b]]:
        b = short[rng.integers(len(short))]
        alloc.grow(b, (len(alloc.blocks(b)) + 1) * BLOCK)
    return alloc.table(range(B), SLOTS)


def assert_same_tokens(a, b):
    np.testing.assert_array_equal(a.num_tokens, b.num_tokens)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_paged_decoding_equals_dense():
    tcfg, tp, dcfg, dp, prompt, lens = model()
    key = jax.random.key(0)
    dense = loop_args(max_new=MAX_NEW, num_slots=SLOTS)
    paged = loop_args(max_new=MAX_NEW, num_slots=SLOTS, paging=PAGING)
    # the fused decode kernel declines the paged cache (it writes dense rows in place)
    kernels = Kernels(("fused_decode", "reference"), interpret=True)
    ar = ar_generate(tp, prompt, lens, key, cfg=tcfg, **dense)
    ar_paged = ar_generate(tp, prompt, lens, key, scattered_table(lens, 1, 0), cfg=tcfg,
                           **loop_args(max_new=MAX_NEW, num_slots=SLOTS, paging=PAGING,
                                       kernels=kernels))
    assert_same_tokens(ar_paged, ar)
    spec = dict(tcfg=tcfg, dcfg=dcfg, tree_spec=SPEC)
    sd, stats = spec_generate(tp, dp, prompt, lens, key, **spec, **dense)
    sd_paged, stats_paged = spec_generate(tp, dp, prompt, lens, key,
                                          scattered_table(lens, EXTRA, 1), **spec, **paged)
    assert_same_tokens(sd_paged, sd)
    np.testing.assert_array_equal(stats_paged.accepted, stats.accepted)


def test_rows_grow_and_free_blocks_between_streamed_rounds():
    """The server's way: a chunk of rounds stops when an unfinished row's blocks cannot hold
    the next round; between chunks rows grow to what the next two rounds may write
    (`slots_ahead`) and finished rows give their blocks back. The text equals the dense run."""
    tcfg, tp, dcfg, dp, prompt, lens = model()
    key, ahead = jax.random.key(0), slots_ahead(SPEC.budget, dcfg.block_size, 2)
    spec = dict(tcfg=tcfg, dcfg=dcfg, tree_spec=SPEC)
    sd, _ = spec_generate(tp, dp, prompt, lens, key, **spec,
                          **loop_args(max_new=MAX_NEW, num_slots=SLOTS))
    steps = streaming.spec_steps(tcfg, dcfg, SPEC, loop=Loop(MAX_NEW, SLOTS, paging=PAGING),
                                 sampler=Sampler(), chunk=MAX_NEW)
    alloc = BlockAllocator(PAGING)
    for b in range(B):
        alloc.grow(b, int(lens[b]) + ahead)
    state = steps.start(tp, dp, prompt, lens, key, alloc.table(range(B), SLOTS),
                        **steps.start_static)
    # the head's context is paged in the same blocks
    np.testing.assert_array_equal(state.draft_cache.table, state.cache.table)
    assert state.draft_cache.k[0].shape[0] == PAGING.num_blocks
    calls = 0
    while not np.all(state.out.done):
        lengths = np.asarray(state.cache.lengths)
        for b, (n, done) in enumerate(zip(lengths, np.asarray(state.out.done))):
            alloc.free(b) if done else alloc.grow(b, int(n) + ahead)
        state = retable(state, alloc.table(range(B), SLOTS))
        state = steps.advance(tp, dp, state, **steps.advance_static)
        assert np.any(np.asarray(state.cache.lengths) > lengths)  # every chunk gets on
        calls += 1
    assert_same_tokens(state.out, sd)
    assert calls > 2  # blocks for 2 rounds at a time: the chunks stopped for blocks


def test_allocator_gives_each_block_once_and_takes_all_back():
    paging = Paging(block_size=4, num_blocks=9)
    alloc = BlockAllocator(paging)
    rng = np.random.default_rng(0)
    for _ in range(200):
        row = int(rng.integers(0, 4))
        if rng.random() < 0.3:
            alloc.free(row)
        else:
            try:
                alloc.grow(row, int(rng.integers(0, 20)))
            except OutOfBlocks:
                pass
        held = [blk for r in range(4) for blk in alloc.blocks(r)]
        assert len(held) == len(set(held)) and NULL_BLOCK not in held
        assert len(held) + alloc.num_free == paging.num_blocks - 1
    for r in range(4):
        alloc.free(r)
    alloc.grow("one row", (paging.num_blocks - 1) * paging.block_size)  # all of them, again
    assert sorted(alloc.blocks("one row")) == list(range(1, paging.num_blocks))


def test_exhausted_pool_raises_and_gives_nothing():
    alloc = BlockAllocator(Paging(block_size=4, num_blocks=4))
    alloc.grow("a", 8)
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks .* 1 of the pool's 3 are free"):
        alloc.grow("b", 5)
    assert alloc.num_free == 1 and alloc.blocks("b") == ()
    alloc.grow("a", 3)  # already held: nothing more
    assert len(alloc.blocks("a")) == 2
    table = alloc.table(["a", "b"], 16)
    np.testing.assert_array_equal(table, [[*alloc.blocks("a"), NULL_BLOCK, NULL_BLOCK],
                                          [NULL_BLOCK] * 4])
    with pytest.raises(ValueError, match="room for 1"):
        alloc.table(["a"], 4)


def test_paged_shapes_are_checked():
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        Loop(max_new=4, num_slots=10, paging=Paging(4, 8))
    with pytest.raises(ValueError, match="block table"):
        KVCache.allocate(1, B, K, 16, H, jnp.float32, Paging(4, 8), np.zeros((B, 3), np.int32))


def test_generate_pages_the_batch_by_each_prompts_length():
    tcfg, tp, _, _, _, _ = model()
    target = api.Target(tcfg, tp, None, tcfg.name)
    prompts = [[5, 9, 3, 1, 7, 7, 2, 8, 9, 4, 4], [6], [2, 3]]
    paging, table, slots = api.paged_layout(prompts, MAX_NEW, EXTRA, 62, BLOCK)
    need = [-(-(len(p) + MAX_NEW + EXTRA) // BLOCK) for p in prompts]
    assert slots == 64 and (table != NULL_BLOCK).sum(axis=1).tolist() == need
    assert paging.num_blocks == api.bucket(1 + sum(need)) < 1 + B * slots // BLOCK
    kw = dict(max_new_tokens=MAX_NEW, chat=False)
    dense = api.generate(target, prompts, **kw)
    assert api.generate(target, prompts, kv_block_size=BLOCK, **kw).tokens == dense.tokens
    with pytest.raises(ValueError, match="kv_block_size"):
        api.generate(target, prompts, kv_block_size=0, **kw)


def test_paged_state_shards_the_pools_by_kv_head():
    cache = KVCache.allocate(2, B, 4, 16, H, jnp.float32, Paging(4, 9), np.zeros((B, 4)))
    specs = state_specs(cache, {"tp": 2})
    assert specs.k[1] == specs.v[0] == PartitionSpec(None, "tp", None, None)
    assert specs.table == PartitionSpec() and cache.num_slots == 16


def test_has_room_counts_the_blocks_a_row_holds():
    table = np.array([[3, 5, NULL_BLOCK, NULL_BLOCK], [1, 2, 4, 6]])
    cache = KVCache.allocate(1, 2, K, 16, H, jnp.float32, Paging(4, 7), table).replace(
        lengths=jnp.asarray([5, 13], jnp.int32))
    assert cache.has_room(3).tolist() == [True, True]  # slots 5..7 and 13..15
    assert cache.has_room(4).tolist() == [False, False]  # one past each row's blocks
    assert KVCache.allocate(1, 2, K, 16, H, jnp.float32).has_room(100) is None
