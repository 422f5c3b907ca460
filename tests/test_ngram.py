"""Context n-gram chains (draft/ngram.py): the lookup, the merged trees, and lossless decoding
with chains added to a head's tree and with the n-gram drafter alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import tiny_head, tiny_target
from test_sampling import check_speculative_sampling
from test_speculative import assert_same, check_stats, run_both
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.draft.ngram import MAX_N, NgramConfig, add_chain, fills_tree, lookup
from jetspec_jax.draft.tree import build_trees, root_trees, topk_from_logits
from jetspec_jax.draft.tree_spec import TreeSpec

SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


def lookup_reference(seq, max_len):
    """The plain loop: longest suffix n <= MAX_N seen before (latest occurrence) -> what
    followed it."""
    for n in range(min(MAX_N, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        for end in range(len(seq) - 2, n - 2, -1):
            if seq[end - n + 1:end + 1] == suffix:
                return seq[end + 1:end + 1 + max_len]
    return []


@SETTINGS
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1,
                     max_size=4), max_len=st.integers(1, 6))
def test_lookup_matches_the_plain_loop(seqs, max_len):
    s = 32
    tokens = np.zeros((len(seqs), s), np.int32)
    for b, q in enumerate(seqs):
        tokens[b, :len(q)] = q
        tokens[b, len(q):] = 7  # past the length: never read
    chain, count = lookup(jnp.asarray(tokens), jnp.asarray([len(q) for q in seqs]), max_len)
    for b, q in enumerate(seqs):
        want = lookup_reference(q, max_len)
        assert int(count[b]) == len(want)
        assert np.asarray(chain[b, :len(want)]).tolist() == want


def check_tree(tree, budget):
    """Valid trees: parents before children, depths = parent's + 1, distinct child tokens per
    parent, valid nodes first and at most budget of them, ancestors = the parent chain."""
    for b in range(tree.tokens.shape[0]):
        tok, par, dep, val = (np.asarray(x[b]) for x in (tree.tokens, tree.parents, tree.depths,
                                                          tree.valid))
        n = int(val.sum())
        assert n <= budget == len(tok) and val[:n].all() and not val[n:].any()
        assert par[0] == -1 and dep[0] == 0
        for i in range(1, n):
            assert 0 <= par[i] < i and dep[i] == dep[par[i]] + 1
        kids = [(par[i], tok[i]) for i in range(1, n)]
        assert len(kids) == len(set(kids))
        anc = np.asarray(tree.ancestors[b])
        for i in range(n):
            want, j = {i}, i
            while par[j] >= 0:
                j = par[j]
                want.add(j)
            assert set(np.flatnonzero(anc[i, :n])) == want


@functools.partial(jax.jit, static_argnames=("width", "budget", "method"))
def build_and_merge(anchor, logits, chain, count, *, width, budget, method):
    """The head's tree from logits [B, D, V], the chain merged onto it and onto the root alone:
    one program per setting (op by op, each new shape compiles each op anew)."""
    tree = build_trees(anchor, *topk_from_logits(logits, width), budget=budget, method=method)
    merge = functools.partial(add_chain, chain=chain, count=count, max_depth=logits.shape[1])
    return tree, merge(tree), merge(root_trees(anchor, budget))


@SETTINGS
@given(seed=st.integers(0, 2**16), budget=st.integers(1, 24), width=st.integers(1, 4),
       method=st.sampled_from(["accum_logp", "top2gap", "chain"]), length=st.integers(1, 8))
def test_merged_trees_are_valid_and_hold_the_chain(seed, budget, width, method, length):
    rng = np.random.default_rng(seed)
    b, depth, vocab = 3, 8, 5
    logits = jnp.asarray(rng.normal(size=(b, depth, vocab)) * 3, jnp.float32)
    length = min(length, budget - 1)
    if length < 1:
        return
    chain = jnp.asarray(rng.integers(0, vocab, (b, length)), jnp.int32)
    count = jnp.asarray(rng.integers(0, length + 1, b), jnp.int32)
    tree, merged, _ = jax.device_get(build_and_merge(
        jnp.asarray(rng.integers(0, vocab, b)), logits, chain, count, width=width,
        budget=budget, method=method))
    check_tree(merged, budget)
    for r in range(b):  # the chain is a path from the root, and the head's nodes come after it
        node = 0
        for k in range(int(count[r])):
            kids = [i for i in range(budget) if merged.valid[r, i] and merged.parents[r, i] == node
                    and merged.tokens[r, i] == chain[r, k]]
            assert kids == [k + 1]
            node = k + 1
        assert int(merged.valid[r].sum()) >= min(budget, int(tree.valid[r].sum()))


@SETTINGS
@given(seed=st.integers(0, 2**16), budget=st.sampled_from([2, 5, 9]),
       width=st.sampled_from([1, 3]))
def test_a_chain_that_fills_the_budget_leaves_the_drafted_tree_no_node(seed, budget, width):
    """What the round skips drafting when `fills_tree`: merged onto the head's tree or onto
    the root alone, a full chain gives the same tree (scores aside, which only adaptive
    budgets read)."""
    rng = np.random.default_rng(seed)
    b, depth, vocab = 4, 8, 4  # a small vocabulary: chains share tokens with the tree
    logits = jnp.asarray(rng.normal(size=(b, depth, vocab)) * 3, jnp.float32)
    anchor = jnp.asarray(rng.integers(0, vocab, b), jnp.int32)
    length = budget - 1
    chain = jnp.asarray(rng.integers(0, vocab, (b, length)), jnp.int32)
    count = jnp.asarray(rng.integers(length - 1, length + 1, b), jnp.int32)
    active = jnp.asarray(rng.random(b) < 0.8)
    full = bool(fills_tree(chain, count, budget, active))
    assert full == bool(jnp.all((count == length) | ~active))
    assert fills_tree(chain[:, :-1], count, budget, active) is None  # too short ever to fill
    _, merged, bare = build_and_merge(anchor, logits, chain, count, width=width, budget=budget,
                                      method="accum_logp")
    for r in np.flatnonzero(np.asarray(count == length)):
        for field in ("tokens", "parents", "depths", "valid", "ancestors"):
            np.testing.assert_array_equal(getattr(merged, field)[r], getattr(bare, field)[r])


REPEATS = [  # (budget, ngram, block size): chains on a head's tree
    (4, 3, 6), (16, 8, 8), (8, 16, 6), (64, 5, 8)]


def repeated_prompts(rng, batch, vocab, width=16):
    """Prompts made of a short random phrase repeated: matches are certain."""
    prompt = np.zeros((batch, width), np.int32)
    lens = rng.integers(6, width + 1, size=batch)
    for b, n in enumerate(lens):
        phrase = rng.integers(0, vocab, size=rng.integers(2, 5))
        prompt[b, :n] = np.resize(phrase, n)
    return jnp.asarray(prompt), jnp.asarray(lens, jnp.int32)


def check_greedy(make_draft, spec, seed, vocab=12):
    """Greedy SD with the drafter make_draft(target config, seed) equals AR on prompts with
    repeats, and its stats add up."""
    rng = np.random.default_rng(seed)
    tcfg, tp = tiny_target("dense", seed=seed % 5, vocab=vocab)
    dcfg, dp = make_draft(tcfg, seed)
    prompt, lens = repeated_prompts(rng, 3, vocab)
    ar, sd, stats = run_both(tcfg, tp, dcfg, dp, prompt, lens, spec)
    assert_same(ar, sd)
    check_stats(sd, stats)


@pytest.mark.parametrize("budget,ngram,block", REPEATS)
@SETTINGS
@given(seed=st.integers(0, 2**16))
def test_greedy_with_context_chains_equals_autoregressive(budget, ngram, block, seed):
    check_greedy(lambda tcfg, s: tiny_head(tcfg, seed=s % 3 + 7, block_size=block),
                 TreeSpec(budget, 3, ngram=ngram), seed)


@pytest.mark.parametrize("max_len,budget", [(1, 64), (4, 64), (8, 5), (12, 64)])
@SETTINGS
@given(seed=st.integers(0, 2**16))
def test_greedy_ngram_drafter_equals_autoregressive(max_len, budget, seed):
    check_greedy(lambda tcfg, s: (NgramConfig(max_len), {}), TreeSpec(budget), seed)


def test_chains_are_accepted():
    """A random tiny target repeats itself: rounds accept several chain tokens, more than
    the same head without the chain, and the n-gram drafter alone accepts some too."""
    tcfg, tp = tiny_target("dense", seed=3, vocab=6)
    dcfg, dp = tiny_head(tcfg, block_size=8)
    prompt, lens = repeated_prompts(np.random.default_rng(0), 4, tcfg.vocab_size)
    taus = {}
    for name, (dc, d, spec) in {"head": (dcfg, dp, TreeSpec(4, 2)),
                                "chain": (dcfg, dp, TreeSpec(4, 2, ngram=7)),
                                "ngram": (NgramConfig(7), {}, TreeSpec(8))}.items():
        ar, sd, stats = run_both(tcfg, tp, dc, d, prompt, lens, spec, max_new=48)
        assert_same(ar, sd)
        taus[name] = np.asarray(stats.accepted).sum() / np.asarray(stats.rounds).sum()
        if name != "head":
            assert np.asarray(stats.accepted).max() > 3  # longer than a budget-4 head's path
    assert taus["chain"] > taus["head"] and taus["ngram"] > 1.5, taus


@pytest.mark.parametrize("draft", ["chain", "ngram"])
def test_sampling_with_chains_keeps_the_target_distribution(draft):
    sampler = Sampler(temperature=1.0)
    if draft == "chain":
        check_speculative_sampling(sampler, TreeSpec(16, 3, ngram=4), jax.random.key(3))
    else:
        check_speculative_sampling(sampler, TreeSpec(5), jax.random.key(4),
                                   draft=(NgramConfig(4), {}))


def test_settings_are_checked():
    with pytest.raises(ValueError, match="n-gram chain length must be >= 0"):
        TreeSpec(16, ngram=-1)
    with pytest.raises(ValueError, match="fixed budget"):
        TreeSpec(16, ngram=4, buckets=(4, 16), bucket_costs=(1.0, 2.0))
    with pytest.raises(ValueError, match=">= 1"):
        NgramConfig(0)
