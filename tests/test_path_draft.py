"""Path-conditioned drafting (path_draft.py) and prefix-filled training blocks (prefix_fill.py).

Exact references: a node's conditional logits are those of a draft block whose slots hold the
node's path; the re-grown tree is the top-N of an explicitly enumerated candidate set.
End to end: greedy speculative decoding in path mode equals autoregressive decoding, and
sampling keeps the target's distribution.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import random_prompts, tiny_head, tiny_target
from test_sampling import check_speculative_sampling
from test_speculative import assert_same, check_greedy_case, run_both
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import TreeSpec, spec_generate, working_slots
from jetspec_jax.decode.tree import ancestor_matrix, build_trees, topk_from_logits
from jetspec_jax.draft import head as draft_head, path as path_draft
from jetspec_jax.model import target
from jetspec_jax.train import prefix_fill
from jetspec_jax.train.head_forward import head_logits, target_pass

ATOL = 2e-5
# Jitted once per config: eager op-by-op dispatch is what costs time on the CPU.
jit_head_hidden = jax.jit(draft_head.head_hidden, static_argnums=1)
extend_context = jax.jit(draft_head.extend_context, static_argnums=1)


def draft_context(tcfg, dcfg, dp, rng, lens, slots=96):
    """A draft cache holding random taps for context lengths lens [B]."""
    b = len(lens)
    taps = jnp.asarray(rng.normal(size=(b, max(lens), len(dcfg.tap_layers) * tcfg.hidden_size)),
                       jnp.float32)
    cache = draft_head.allocate_cache(dcfg, b, slots, jnp.float32)
    return draft_head.extend_context(dp, dcfg, cache, taps, jnp.asarray(lens, jnp.int32))


def path_of(tree, b, i):
    """Tokens of node i's path below the root, root first."""
    parents, tokens = np.asarray(tree.parents[b]), np.asarray(tree.tokens[b])
    path = []
    while parents[i] >= 0:
        path.append(int(tokens[i]))
        i = parents[i]
    return path[::-1]


def test_head_hidden_is_draft_block():
    tcfg, tp = tiny_target("dense", seed=1, vocab=12)
    dcfg, dp = tiny_head(tcfg, block_size=6)
    dcache = draft_context(tcfg, dcfg, dp, np.random.default_rng(0), [5, 2])
    anchor = jnp.asarray([4, 7], jnp.int32)
    want = jax.jit(draft_head.draft_block, static_argnums=(1, 3))(dp, dcfg, tp, tcfg, dcache,
                                                                    anchor)
    x = draft_head.block_inputs(dp, dcfg, tp, anchor)
    pos = dcache.lengths[:, None] + jnp.arange(dcfg.block_size)
    hidden = jit_head_hidden(dp, dcfg, dcache, x, pos, draft_head.block_mask(dcfg, 2))
    np.testing.assert_allclose(np.asarray(target.lm_head(tp, tcfg, hidden[:, 1:])),
                               np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,mask_id,budget,width", [("dense", None, 24, 3),
                                                        ("llama", 3, 12, 2)])
def test_conditional_logits_equal_blocks_holding_the_path(kind, mask_id, budget, width):
    """Node i at depth d: its conditional logits are slot d+1 of the block
    [anchor, t_1..t_d, MASK...] (the path's tokens in place of MASK) against the same context."""
    tcfg, tp = tiny_target(kind, seed=2, vocab=12)
    dcfg, dp = tiny_head(tcfg, seed=5, block_size=6, mask_token_id=mask_id)
    lens = [6, 3]
    dcache = draft_context(tcfg, dcfg, dp, np.random.default_rng(1), lens)
    anchor = jnp.asarray([2, 9], jnp.int32)
    lp, tk = topk_from_logits(draft_head.draft_block(dp, dcfg, tp, tcfg, dcache, anchor), width)
    tree = build_trees(anchor, lp, tk, budget=budget)
    cond = np.asarray(path_draft.conditional_logits(dp, dcfg, tp, tcfg, dcache, tree))
    base = draft_head.block_inputs(dp, dcfg, tp, anchor)
    blk = dcfg.block_size
    checked = 0
    for b in range(2):
        nodes = [i for i in range(budget) if tree.valid[b, i] and tree.depths[b, i] < dcfg.depth]
        x = jnp.repeat(base[b:b + 1], len(nodes), axis=0)
        for row, i in enumerate(nodes):
            path = path_of(tree, b, i)
            if path:
                x = x.at[row, 1:len(path) + 1].set(tp["embed"][jnp.asarray(path)])
        one = jax.tree.map(lambda a: jnp.repeat(a[b:b + 1], len(nodes), axis=0), dcache)
        pos = one.lengths[:, None] + jnp.arange(blk)
        mask = draft_head.block_mask(dcfg, len(nodes))
        hidden = jit_head_hidden(dp, dcfg, one, x, pos, mask)
        logits = np.asarray(target.lm_head(tp, tcfg, hidden))  # [nodes, blk, V]
        for row, i in enumerate(nodes):
            d = int(tree.depths[b, i])
            np.testing.assert_allclose(cond[b, i], logits[row, d + 1], rtol=1e-5, atol=ATOL)
            checked += 1
    assert checked > 2 * dcfg.depth  # branching trees, not only chains


def regrow_reference(tree, logp, width, max_depth):
    """Plain enumeration of the candidates and their scores -> {path tuple: score} of the N
    best (stable sort on score, ties to the lower candidate index)."""
    n = len(tree["tokens"])
    valid, parents, tokens, depths = (tree[k] for k in ("valid", "parents", "tokens", "depths"))
    score = np.zeros(n, np.float32)
    paths = {0: ()}
    for i in range(1, n):  # parents come first
        if valid[i]:
            p = parents[i]
            score[i] = np.float32(score[p] + np.float32(min(logp[p, tokens[i]], 0.0)))
            paths[i] = paths[p] + (int(tokens[i]),)
    cands = [(score[i], paths[i]) for i in range(n) if valid[i]]
    for i in range(n):
        if not valid[i] or depths[i] >= max_depth:
            continue
        children = {int(tokens[j]) for j in range(n) if valid[j] and parents[j] == i}
        for tok in np.argsort(-logp[i], kind="stable")[:width]:
            if int(tok) not in children:
                cands.append((np.float32(score[i] + np.float32(min(logp[i, tok], 0.0))),
                              paths[i] + (int(tok),)))
    ranked = sorted(range(len(cands)), key=lambda c: -cands[c][0])  # stable: index on ties
    return {cands[c][1]: cands[c][0] for c in ranked[:n]}, score[valid]


@pytest.mark.parametrize("budget,width,depth", [(4, 1, 5), (16, 3, 2), (40, 3, 5)])
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_regrow_is_top_n_of_the_candidates(budget, width, depth, seed):
    rng = np.random.default_rng(seed)
    vocab, batch = 10, 3
    first = jnp.asarray(rng.normal(size=(batch, depth, vocab)) * 2, jnp.float32)
    lp, tk = topk_from_logits(first, width)
    tree = build_trees(jnp.asarray(rng.integers(0, vocab, batch), jnp.int32), lp, tk,
                       budget=budget)
    logp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(batch, budget, vocab)) * 2,
                                          jnp.float32))
    grow = functools.partial(path_draft._regrow, width=width, max_depth=depth)
    new = jax.tree.map(np.asarray, jax.vmap(grow)(tree, logp))
    old = jax.tree.map(np.asarray, tree)
    logp = np.asarray(logp)
    for b in range(batch):
        first_tree = {k: getattr(old, k)[b] for k in ("valid", "parents", "tokens", "depths")}
        want, rescored = regrow_reference(first_tree, logp[b], width, depth)
        v, par, tok, dep, sc = (getattr(new, k)[b]
                                for k in ("valid", "parents", "tokens", "depths", "scores"))
        nv = int(v.sum())
        assert v[:nv].all() and not v[nv:].any()  # valid nodes first
        assert tok[0] == old.tokens[b, 0] and par[0] == -1 and dep[0] == 0  # root = anchor
        paths = {0: ()}
        for i in range(1, nv):
            assert 0 <= par[i] < i and dep[i] == dep[par[i]] + 1 <= depth
            paths[i] = paths[par[i]] + (int(tok[i]),)
        got = {paths[i]: sc[i] for i in range(nv)}
        assert len(got) == nv  # siblings have distinct tokens
        assert got.keys() == want.keys()
        for p in got:
            np.testing.assert_allclose(got[p], want[p], rtol=0, atol=1e-6)
        # Under the head's own conditionals the refined tree expects at least as many tokens.
        assert np.exp(sc[:nv]).sum() >= np.exp(rescored).sum() - 1e-5
        np.testing.assert_array_equal(new.ancestors[b], np.asarray(ancestor_matrix(
            jnp.asarray(par), depth)))


PATH_CASES = [
    # (target kind, budget, width, method, block size, causal, mask token id or learned)
    ("dense", 16, 3, "accum_logp", 6, True, None),
    ("moe", 32, 4, "top2gap", 5, True, 3),
    ("llama", 64, 7, "accum_logp", 8, True, None),
    ("dense", 8, 1, "chain", 6, False, 3),
]


@pytest.mark.parametrize("kind,budget,width,method,block,causal,mask_id", PATH_CASES)
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_path_mode_greedy_equals_autoregressive(kind, budget, width, method, block, causal,
                                                mask_id, seed):
    stats = check_greedy_case(kind, TreeSpec(budget, width, method, draft_mode="path"), block,
                              causal, mask_id, seed)
    rounds = np.asarray(stats.rounds)
    nodes = np.asarray(stats.nodes)
    assert all((nodes[b, :r] == budget).all() for b, r in enumerate(rounds))


def test_path_mode_accepts_stops_and_changes_the_trees():
    tcfg, tp = tiny_target("dense", seed=3, vocab=6)
    dcfg, dp = tiny_head(tcfg, block_size=8)
    prompt, lens = random_prompts(np.random.default_rng(0), 4, 6, tcfg.vocab_size)
    accepted = {}
    for mode in ("per_depth", "path"):
        ar, sd, stats = run_both(tcfg, tp, dcfg, dp, prompt, lens,
                                 TreeSpec(32, 4, draft_mode=mode), stop_ids=(5,))
        assert_same(ar, sd)
        accepted[mode] = np.asarray(stats.accepted)
    assert accepted["path"].max() >= 3  # multi-token rounds
    # The refined trees differ from the per-depth ones (seeds fixed: deterministic).
    assert not np.array_equal(accepted["path"], accepted["per_depth"])


def test_path_mode_sampling_matches_target_distribution():
    check_speculative_sampling(Sampler(temperature=1.0), TreeSpec(16, 3, draft_mode="path"),
                               jax.random.key(3), num_slots=48)  # the second pass: 2 * 16 slots


def test_path_mode_needs_room_for_its_second_pass():
    assert working_slots(32, 6, "path") == working_slots(64, 6) == 70
    tcfg, tp = tiny_target("dense", vocab=12)
    dcfg, dp = tiny_head(tcfg, block_size=6)
    prompt, lens = random_prompts(np.random.default_rng(0), 2, 5, tcfg.vocab_size)
    with pytest.raises(ValueError, match="working slots"):  # 5 + 8 + 70 > 64
        spec_generate(tp, dp, prompt, lens, jax.random.key(0), tcfg=tcfg, dcfg=dcfg,
                      tree_spec=TreeSpec(32, draft_mode="path"), max_new=8, sampler=Sampler(),
                      stop_ids=(), num_slots=64)


# ---- prefix-filled training blocks -------------------------------------------------------------


def training_batch(seed=0):
    tcfg, tp = tiny_target("dense", seed=4, vocab=12)
    dcfg, dp = tiny_head(tcfg, seed=6, block_size=5)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 12, size=(2, 14)), jnp.int32)
    anchors = jnp.asarray([[0, 3, 8], [2, 5, 11]], jnp.int32)
    _, taps = jax.jit(target_pass, static_argnums=(1, 3))(tp, tcfg, tokens, dcfg.tap_layers)
    return tcfg, tp, dcfg, dp, tokens, anchors, taps


def test_prefix_fill_zero_is_head_logits():
    tcfg, tp, dcfg, dp, tokens, anchors, taps = training_batch()
    want = jax.jit(head_logits, static_argnums=(1, 3))(dp, dcfg, tp, tcfg, taps, tokens, anchors)
    got = jax.jit(head_logits, static_argnums=(1, 3))(
        dp, dcfg, tp, tcfg, taps, tokens, anchors, jnp.zeros(anchors.shape, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_prefix_fill_matches_the_path_conditioned_inference_block():
    """Block at anchor a with fill f: slot d > f drafts like the inference head on the block
    [t_a, t_{a+1}..t_{a+f}, MASK...] against the context of positions < a."""
    tcfg, tp, dcfg, dp, tokens, anchors, taps = training_batch(1)
    fill = jnp.asarray([[1, 3, 0], [2, 0, 3]], jnp.int32)
    got = np.asarray(jax.jit(head_logits, static_argnums=(1, 3))(
        dp, dcfg, tp, tcfg, taps, tokens, anchors, fill))
    keep = np.asarray(prefix_fill.supervised(fill, dcfg.depth))
    np.testing.assert_array_equal(keep.sum(-1), dcfg.depth - np.asarray(fill))
    x = prefix_fill.filled_block_inputs(dp, dcfg, tp, tokens, anchors, fill)
    x = x.reshape(6, dcfg.block_size, -1)
    for b in range(2):
        for j in range(3):
            a = int(anchors[b, j])
            # Context = taps of positions < a (rows past a are written but stay invisible).
            cache = extend_context(dp, dcfg, draft_head.allocate_cache(dcfg, 1, 32, jnp.float32),
                                   taps[b:b + 1], jnp.asarray([a], jnp.int32))
            pos = a + jnp.arange(dcfg.block_size)[None]
            hidden = jit_head_hidden(dp, dcfg, cache, x[b * 3 + j][None], pos,
                                     draft_head.block_mask(dcfg, 1))
            want = np.asarray(target.lm_head(tp, tcfg, hidden[:, 1:]))[0]
            np.testing.assert_allclose(got[b, j][keep[b, j]], want[keep[b, j]], rtol=1e-5,
                                       atol=ATOL)


def test_sample_fill_range():
    fill = np.asarray(prefix_fill.sample_fill(jax.random.key(0), (400,), 6, 0.5))
    assert fill.min() == 0 and fill.max() == 4 and 0.3 < (fill > 0).mean() < 0.7
    assert not np.asarray(prefix_fill.sample_fill(jax.random.key(0), (50,), 2, 1.0)).any()
