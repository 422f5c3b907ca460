"""Adaptive draft budget (adaptive.py): bucket trees are prefixes, the expected-acceptance
formula against brute force, the chooser's argmax, and lossless decoding with a per-round
budget chosen on device."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import random_prompts, tiny_head, tiny_target, tree_equal
from test_sampling import check_speculative_sampling
from test_speculative import assert_same, check_stats, run_both
from jetspec_jax import costs
from jetspec_jax.decode import adaptive
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import TreeSpec
from jetspec_jax.draft.tree import build_trees, topk_from_logits

BUCKETS = (4, 8, 16)


def random_trees(seed, budget, method, width=3, depth=4, vocab=9, batch=3):
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-1, 1.5, size=(batch, depth, 1)))
    logits = jnp.asarray(rng.normal(size=(batch, depth, vocab)) * scale, jnp.float32)
    lp, tk = topk_from_logits(logits, width)
    roots = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    return roots, lp, tk, logits


@pytest.mark.parametrize("method", ["accum_logp", "top2gap", "chain"])
def test_bucket_trees_are_prefixes_of_the_largest(method):
    for seed in range(3):
        roots, lp, tk, _ = random_trees(seed, 64, method)
        big = build_trees(roots, lp, tk, budget=64, method=method)
        for b in (1, 4, 13, 32):
            tree_equal(adaptive.prefix_tree(big, b),
                       build_trees(roots, lp, tk, budget=b, method=method))


def test_expected_tokens_equal_brute_force():
    """If the target drew y_d from the draft's own per-depth distributions q_d, a round would
    commit 1 + (deepest tree node matching y) tokens; enumerate every y and average."""
    vocab, depth = 4, 3
    roots, lp, tk, logits = random_trees(7, 20, "accum_logp", width=2, depth=depth, vocab=vocab)
    tree = jax.tree.map(np.asarray, build_trees(roots, lp, tk, budget=20))
    q = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)  # [B, D, V]
    got = np.asarray(adaptive.expected_tokens(tree.scores, tree.valid, (1, 5, 12, 20)))
    for b in range(3):
        for j, n in enumerate((1, 5, 12, 20)):
            paths = {}
            for i in range(1, n):
                if tree.valid[b, i]:
                    p, path = i, []
                    while p > 0:
                        path.append(int(tree.tokens[b, p]))
                        p = tree.parents[b, p]
                    paths[tuple(path[::-1])] = i
            want = 0.0
            for y in itertools.product(range(vocab), repeat=depth):
                prob = np.prod([q[b, d, y[d]] for d in range(depth)])
                matched = max([d for d in range(1, depth + 1) if y[:d] in paths], default=0)
                want += prob * (1 + matched)
            np.testing.assert_allclose(got[b, j], want, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_chooser_takes_the_argmax_of_tokens_per_second(seed):
    rng = np.random.default_rng(seed)
    batch, nb = 4, 5
    expected = np.cumsum(rng.uniform(0, 2, size=(batch, nb)), axis=1).astype(np.float32) + 1
    active = rng.uniform(size=batch) < 0.7
    costs = np.sort(rng.uniform(0.5, 3.0, size=nb)).astype(np.float32)
    got = int(adaptive.choose_bucket(jnp.asarray(expected), jnp.asarray(active),
                                     tuple(costs.tolist())))
    rate = (expected * active[:, None]).sum(0) / costs
    assert rate[got] == rate.max()


def test_chooser_extremes():
    expected = jnp.asarray([[1.5, 2.0, 2.2]], jnp.float32)
    active = jnp.asarray([True])
    assert int(adaptive.choose_bucket(expected, active, (1.0, 1.0, 1.0))) == 2  # free: largest
    assert int(adaptive.choose_bucket(expected, active, (1.0, 5.0, 9.0))) == 0  # dear: smallest
    assert int(adaptive.choose_bucket(expected, active, (1.0, 1.2, 2.0))) == 1


ADAPTIVE_CASES = [
    # (target kind, costs of BUCKETS, block size, width, method)
    ("dense", (1.0, 1.15, 1.5), 6, 3, "accum_logp"),
    ("moe", (1.0, 1.0, 1.0), 5, 4, "top2gap"),
    ("llama", (1.0, 1.1, 1.3), 8, 3, "accum_logp"),
]


@pytest.mark.parametrize("kind,costs,block,width,method", ADAPTIVE_CASES)
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_adaptive_greedy_equals_autoregressive(kind, costs, block, width, method, seed):
    rng = np.random.default_rng(seed)
    tcfg, tp = tiny_target(kind, seed=seed % 5, vocab=8)
    dcfg, dp = tiny_head(tcfg, seed=seed % 3 + 7, block_size=block)
    prompt, lens = random_prompts(rng, 3, 7, tcfg.vocab_size)
    spec = TreeSpec(BUCKETS[-1], width, method, buckets=BUCKETS, bucket_costs=costs)
    ar, sd, stats = run_both(tcfg, tp, dcfg, dp, prompt, lens, spec)
    assert_same(ar, sd)
    check_stats(sd, stats)
    nodes, rounds = np.asarray(stats.nodes), np.asarray(stats.rounds)
    used = np.concatenate([nodes[b, :r] for b, r in enumerate(rounds)])
    assert set(used.tolist()) <= set(BUCKETS)


def test_adaptive_choice_changes_from_round_to_round():
    """With costs between the extremes (`test_chooser_extremes`) the chosen bucket follows
    the draft's confidence, round by round."""
    tcfg, tp = tiny_target("dense", seed=3, vocab=6)
    dcfg, dp = tiny_head(tcfg, block_size=6)
    prompt, lens = random_prompts(np.random.default_rng(0), 4, 6, tcfg.vocab_size)
    spec = TreeSpec(16, 3, buckets=BUCKETS, bucket_costs=(1.0, 1.12, 1.3))
    ar, sd, stats = run_both(tcfg, tp, dcfg, dp, prompt, lens, spec)
    assert_same(ar, sd)
    nodes, rounds = np.asarray(stats.nodes), np.asarray(stats.rounds)
    assert len(set(np.concatenate([nodes[b, :r] for b, r in enumerate(rounds)]))) >= 2


def test_adaptive_sampling_matches_target_distribution():
    spec = TreeSpec(16, 3, buckets=BUCKETS, bucket_costs=(1.0, 1.1, 1.25))
    check_speculative_sampling(Sampler(temperature=1.0), spec, jax.random.key(4))


def test_measure_costs_and_auto_tree_spec():
    tcfg, tp = tiny_target("dense", vocab=12)
    dcfg, dp = tiny_head(tcfg, block_size=6)
    table = costs.measure_costs(tp, tcfg, dp, dcfg, buckets=(4, 8), width=3, batch=2,
                                context_len=10, repeats=2)
    assert sorted(table) == [4, 8] and all(t > 0 for t in table.values())
    spec = costs.auto_tree_spec(table, width=3)
    assert spec.budget == 8 and spec.buckets == (4, 8) and len(spec.bucket_costs) == 2


@pytest.mark.parametrize("kw", [dict(budget=16, buckets=(4, 8), bucket_costs=(1.0, 1.0)),
                                dict(budget=16, buckets=(16, 4), bucket_costs=(1.0, 1.0)),
                                dict(budget=16, buckets=(4, 16), bucket_costs=(1.0,)),
                                dict(budget=16, buckets=(4, 16), bucket_costs=(1.0, 0.0))])
def test_tree_spec_rejects_bad_adaptive_settings(kw):
    with pytest.raises(ValueError):
        TreeSpec(**kw)
