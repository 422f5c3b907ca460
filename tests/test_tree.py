"""The jitted draft-tree builder against the NumPy/heapq reference, plus tree invariants."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetspec_jax.draft.tree import (
    METHODS, DraftTree, _grow_batch, _statics, build_tree, build_trees, topk_from_logits,
    tree_caps,
)
from jetspec_jax.draft.tree_spec import reachable_depth
from jetspec_jax.draft.tree_reference import build_tree_numpy, tree_caps_numpy

jax.config.update("jax_enable_x64", False)

BUDGETS = (1, 2, 4, 16, 64, 256)
WIDTHS = (1, 2, 7)
DEPTHS = (1, 3, 15)
VOCAB = 48
BATCH = 6
FIELDS = ("tokens", "parents", "depths", "scores", "valid", "ancestors")
HYP = settings(max_examples=25, deadline=None)

# Each (budget, D, K) shape costs an XLA compile (~0.5-1 s on CPU), so by default the grid is a
# covering array: every pair of (budget, width), (budget, depth), (width, depth) appears once,
# via a Latin square. JETSPEC_FULL_TREE_GRID=1 runs the full product (~70 s).
if os.environ.get("JETSPEC_FULL_TREE_GRID"):
    GRID = list(itertools.product(BUDGETS, WIDTHS, DEPTHS))
else:
    GRID = [(n, k, DEPTHS[(i + j) % 3])
            for i, n in enumerate(BUDGETS) for j, k in enumerate(WIDTHS)]


def random_topk(rng, batch, depth, width):
    """Draft log-probs with a per-row temperature so top2gap caps span 1..K."""
    scale = np.exp(rng.uniform(np.log(0.1), np.log(10.0), size=(batch, depth, 1)))
    logits = (rng.normal(size=(batch, depth, VOCAB)) * scale).astype(np.float32)
    lp, tk = topk_from_logits(jnp.asarray(logits), width)  # [B, D, K] each
    roots = rng.integers(0, VOCAB, size=batch).astype(np.int32)
    return roots, np.asarray(lp), np.asarray(tk)


def tree_at(tree: DraftTree, b=None) -> dict:
    return {f: np.asarray(getattr(tree, f)) if b is None else np.asarray(getattr(tree, f))[b]
            for f in FIELDS}


def assert_same(got: dict, want: dict, ctx=""):
    for f in FIELDS:
        if f == "scores":
            np.testing.assert_allclose(got[f], want[f], rtol=0, atol=1e-6, err_msg=f"{f} {ctx}")
            np.testing.assert_array_equal(np.isinf(got[f]), np.isinf(want[f]), err_msg=ctx)
        else:
            np.testing.assert_array_equal(got[f], want[f], err_msg=f"{f} {ctx}")


def max_nodes(lp, method, beta=1.0, g0=1.0) -> int:
    level, total = 1, 1
    for cap in tree_caps_numpy(lp, method, beta, g0):
        level *= int(cap)
        total += level
    return total


def check_invariants(t: dict, lp, tk, budget, method, beta=1.0, g0=1.0):
    num = int(t["valid"].sum())
    assert num == min(budget, max_nodes(lp, method, beta, g0))
    assert t["valid"][:num].all() and not t["valid"][num:].any()  # valid nodes are a prefix
    assert t["parents"][0] == -1 and t["depths"][0] == 0 and t["scores"][0] == 0
    kids = np.arange(1, num)
    par = t["parents"][kids]
    assert (par >= 0).all() and (par < kids).all()
    assert (t["depths"][kids] == t["depths"][par] + 1).all()
    assert (t["depths"] <= lp.shape[0]).all()
    # token and score come from the parent depth's candidate row
    rows = t["depths"][kids] - 1
    slot = [list(tk[r]).index(tok) for r, tok in zip(rows, t["tokens"][kids])]
    np.testing.assert_allclose(t["scores"][kids], t["scores"][par] + lp[rows, slot], atol=1e-6)
    for p in np.unique(par):  # siblings are distinct tokens
        sib = t["tokens"][kids][par == p]
        assert len(set(sib.tolist())) == len(sib)
    # padding
    assert (t["parents"][num:] == -1).all() and (t["tokens"][num:] == 0).all()
    assert (t["depths"][num:] == 0).all() and np.isneginf(t["scores"][num:]).all()
    # ancestors: self | parent's row, for every node (padding rows are self only)
    anc = t["ancestors"]
    for n in range(budget):
        want = np.zeros(budget, bool)
        if t["parents"][n] >= 0:
            want |= anc[t["parents"][n]]
        want[n] = True
        np.testing.assert_array_equal(anc[n], want)


@pytest.mark.parametrize("budget,width,depth", GRID)
def test_batched_matches_reference(budget, width, depth):
    rng = np.random.default_rng([budget, width, depth])
    for method in METHODS:
        roots, lp, tk = random_topk(rng, BATCH, depth, width)
        got = build_trees(roots, lp, tk, budget=budget, method=method)
        assert got.tokens.shape == (BATCH, budget)
        assert got.ancestors.shape == (BATCH, budget, budget)
        for b in range(BATCH):
            want = build_tree_numpy(roots[b], lp[b], tk[b], budget, method)
            assert_same(tree_at(got, b), want, f"{method} row {b}")
            check_invariants(tree_at(got, b), lp[b], tk[b], budget, method)


@pytest.mark.parametrize("method", METHODS)
def test_draft_depths_past_the_reachable_one_change_nothing(method):
    """The speculative round drafts only reachable_depth(budget, width, method) depths: the
    trees must be those of all 15 depths, and no tree may go deeper. Each shape costs two
    compiles, so the shapes are the edges: reach 1 (2, 3); accum_logp's ceiling with and
    without a remainder (9, 3) -> 3 and (15, 7) -> 2, where chain and top2gap cut one depth
    (reach 14); reach exactly 15 (16, 1); reach past 15 (64, 7), where only accum_logp cuts."""
    rng = np.random.default_rng(7)
    for budget, width in [(2, 3), (9, 3), (15, 7), (16, 1), (64, 7)]:
        reach = reachable_depth(budget, width, method)
        roots, lp, tk = random_topk(rng, BATCH, 15, width)
        full = build_trees(roots, lp, tk, budget=budget, method=method)
        assert int(full.depths.max()) <= reach, (budget, width)
        if reach < 15:
            cut = build_trees(roots, lp[:, :reach], tk[:, :reach], budget=budget, method=method)
            for name in ("tokens", "parents", "depths", "scores", "valid", "ancestors"):
                np.testing.assert_array_equal(getattr(cut, name), getattr(full, name),
                                              f"{name} budget {budget} width {width}")


@pytest.mark.parametrize("budget,width,depth", GRID)
def test_unbatched_matches_reference(budget, width, depth):
    rng = np.random.default_rng([budget, width, depth, 1])
    for method in METHODS:
        roots, lp, tk = random_topk(rng, 4, depth, width)
        for b in range(4):
            got = tree_at(build_tree(roots[b], lp[b], tk[b], budget=budget, method=method))
            assert_same(got, build_tree_numpy(roots[b], lp[b], tk[b], budget, method), method)
        # the batched builder agrees with the single-tree one
        batched = build_trees(np.resize(roots, BATCH), np.resize(lp, (BATCH,) + lp.shape[1:]),
                              np.resize(tk, (BATCH,) + tk.shape[1:]), budget=budget, method=method)
        assert_same(tree_at(batched, 3), got)


@HYP
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.sampled_from(GRID),
    method=st.sampled_from(METHODS),
    beta=st.floats(0.1, 5.0),
    g0=st.floats(-1.0, 3.0),
)
def test_random_seeds_and_top2gap_params(seed, shape, method, beta, g0):
    budget, width, depth = shape
    roots, lp, tk = random_topk(np.random.default_rng(seed), BATCH, depth, width)
    got = build_trees(roots, lp, tk, budget=budget, method=method, beta=beta, g0=g0)
    for b in range(BATCH):
        want = build_tree_numpy(roots[b], lp[b], tk[b], budget, method, beta, g0)
        assert_same(tree_at(got, b), want)
        check_invariants(tree_at(got, b), lp[b], tk[b], budget, method, beta, g0)


@HYP
@given(
    seed=st.integers(0, 2**32 - 1),
    values=st.lists(st.sampled_from([0.0, -0.5, -1.0, -1.5, -2.0, -np.inf]), min_size=1,
                    max_size=4, unique=True),
    shape=st.sampled_from([s for s in GRID if s[0] >= 16]),
    method=st.sampled_from(METHODS),
)
def test_ties(seed, values, shape, method):
    """Coarse log-probs give many exactly equal cumulative scores (and -inf ones): the pop order
    must break ties by insertion index exactly like the heap."""
    budget, width, depth = shape
    rng = np.random.default_rng(seed)
    lp = -np.sort(-rng.choice(np.float32(values), size=(BATCH, depth, width)), axis=-1)  # desc
    tk = np.argsort(rng.random((BATCH, depth, VOCAB)), axis=-1)[..., :width].astype(np.int32)
    roots = np.arange(BATCH, dtype=np.int32)
    got = build_trees(roots, lp, tk, budget=budget, method=method)
    for b in range(BATCH):
        assert_same(tree_at(got, b), build_tree_numpy(roots[b], lp[b], tk[b], budget, method))
        check_invariants(tree_at(got, b), lp[b], tk[b], budget, method)


# Every (budget, width), and every pair of the four factors, once: depth and method by Latin
# squares over the 18 (budget, width) pairs.
TIE_GRID = [(n, k, DEPTHS[(i + j) % 3], METHODS[(i + 2 * j) % 3])
            for i, n in enumerate((1, 2, 5, 16, 64, 256)) for j, k in enumerate(WIDTHS)]


@pytest.mark.parametrize("budget,width,depth,method", TIE_GRID)
def test_many_ties_both_builders(budget, width, depth, method):
    """Log-probs from {0, -0.5, -1, -inf}: most cumulative scores tie, within and across depths.
    Both builders (the sorted one and the pop loop; build_trees picks one per method) must give
    the reference's tree, so they agree with each other too."""
    rng = np.random.default_rng([budget, width, depth, METHODS.index(method)])
    values = np.float32([0.0, -0.5, -1.0, -np.inf])
    lp = rng.choice(values, p=[0.3, 0.3, 0.3, 0.1], size=(8, depth, width))
    lp[:4] = -np.sort(-lp[:4], axis=-1)  # top-k order in half the rows, any order in the rest
    tk = np.argsort(rng.random((8, depth, VOCAB)), axis=-1)[..., :width].astype(np.int32)
    roots = np.arange(8, dtype=np.int32)
    caps = tree_caps(jnp.asarray(lp), method)
    static = _statics(budget, method, depth, width)
    trees = {loop: _grow_batch(roots, lp, tk, caps, **{**static, "loop": loop})
             for loop in (False, True)}
    for b in range(8):
        want = build_tree_numpy(roots[b], lp[b], tk[b], budget, method)
        for loop, got in trees.items():
            assert_same(tree_at(got, b), want, f"{method} row {b} loop={loop}")


def test_ties_prefer_earliest_inserted():
    # Every candidate has log-prob -1: all nodes of a depth tie, and the first-inserted wins.
    lp = np.full((3, 2), -1.0, np.float32)
    tk = np.array([[10, 11], [20, 21], [30, 31]], np.int32)
    t = build_tree(1, lp, tk, budget=9, method="accum_logp")
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 3]
    assert t.tokens.tolist() == [1, 10, 11, 20, 21, 20, 21, 30, 31]
    assert_same(tree_at(t), build_tree_numpy(1, lp, tk, 9, "accum_logp"))


def test_top2gap_caps_bankers_rounding():
    # gap == g0 -> sigmoid(0) = 0.5 -> K / 2: 3.5 -> 4 and 2.5 -> 2 (half to even, like round()).
    for width, want in ((7, 4), (5, 2), (2, 1)):
        lp = np.array([[-0.5, -1.5] + [-3.0] * (width - 2)], np.float32)
        assert int(tree_caps(jnp.asarray(lp), "top2gap")[0]) == want
        assert int(tree_caps_numpy(lp, "top2gap")[0]) == want
    lp = np.array([[-0.1], [-2.0]], np.float32)  # K = 1: always one child
    assert tree_caps(jnp.asarray(lp), "top2gap").tolist() == [1, 1]
    nan_gap = np.array([[-np.inf, -np.inf, -np.inf]], np.float32)
    assert int(tree_caps(jnp.asarray(nan_gap), "top2gap")[0]) == 1
    assert tree_caps_numpy(nan_gap, "top2gap")[0] == 1


def test_top2gap_caps_match_reference():
    _, lp, _ = random_topk(np.random.default_rng(3), 64, 15, 7)
    for beta, g0 in ((1.0, 1.0), (0.3, 2.0), (4.0, -0.5)):
        got = np.asarray(tree_caps(jnp.asarray(lp), "top2gap", beta, g0))  # [B, D]
        want = np.stack([tree_caps_numpy(row, "top2gap", beta, g0) for row in lp])
        np.testing.assert_array_equal(got, want)
        assert got.min() >= 1 and got.max() <= 7


def test_chain_and_root_only():
    _, lp, tk = random_topk(np.random.default_rng(0), 1, 15, 7)
    chain = build_tree(3, lp[0], tk[0], budget=8, method="chain")
    assert chain.parents.tolist() == list(range(-1, 7))
    assert chain.tokens[1:].tolist() == tk[0, :7, 0].tolist()
    assert bool(jnp.all(chain.ancestors == jnp.tril(jnp.ones((8, 8), bool))))
    long = build_tree(3, lp[0], tk[0], budget=32, method="chain")
    assert int(long.num_nodes) == 16  # root + D
    root = build_tree(3, lp[0], tk[0], budget=1)
    assert root.tokens.tolist() == [3] and root.valid.tolist() == [True]
    assert root.ancestors.tolist() == [[True]]


def test_helpers_and_jit_composition():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 15, VOCAB)), jnp.float32)

    @jax.jit
    def draft(roots, logits):  # the whole thing traces into one program
        lp, tk = topk_from_logits(logits, 7)
        return build_trees(roots, lp, tk, budget=64, method="top2gap")

    trees = draft(jnp.array([5, 6]), logits)
    lp, tk = topk_from_logits(logits, 7)
    assert lp.dtype == jnp.float32 and tk.dtype == jnp.int32 and lp.shape == (2, 15, 7)
    want_lp, want_tk = jax.lax.top_k(jax.nn.log_softmax(logits), 7)
    np.testing.assert_array_equal(lp, want_lp)  # the same float ops on the chosen entries
    np.testing.assert_array_equal(tk, want_tk)
    assert bool(jnp.all(lp[..., :-1] >= lp[..., 1:]))
    for b in range(2):
        assert_same(tree_at(trees, b), build_tree_numpy(5 + b, lp[b], tk[b], 64, "top2gap"))
    np.testing.assert_array_equal(trees.num_nodes, trees.valid.sum(-1))
    pos = trees.positions(jnp.array([10, 20]))
    np.testing.assert_array_equal(pos, jnp.array([[10], [20]]) + trees.depths)
    single = build_tree(5, lp[0], tk[0], budget=64, method="top2gap")
    np.testing.assert_array_equal(single.positions(7), 7 + single.depths)


def test_bad_inputs():
    lp = jnp.zeros((3, 2), jnp.float32)
    tk = jnp.zeros((3, 2), jnp.int32)
    with pytest.raises(ValueError, match="budget"):
        build_tree(0, lp, tk, budget=0)
    with pytest.raises(ValueError, match="budget"):
        build_trees(jnp.zeros(1, jnp.int32), lp[None], tk[None], budget=-3)
    with pytest.raises(ValueError, match="method"):
        build_tree(0, lp, tk, budget=4, method="beam")
    with pytest.raises(ValueError, match="method"):
        tree_caps(lp, "beam")
    with pytest.raises(ValueError, match="width"):
        build_tree(0, lp[:, :0], tk[:, :0], budget=4)
    with pytest.raises(ValueError, match="width"):
        topk_from_logits(jnp.zeros((3, 10)), 0)
    with pytest.raises(ValueError, match="width"):
        topk_from_logits(jnp.zeros((3, 10)), 11)
    with pytest.raises(ValueError, match="topk_logprobs"):
        build_tree(0, lp, tk[:, :1], budget=4)
    with pytest.raises(ValueError, match="topk_logprobs"):
        build_trees(jnp.zeros(1, jnp.int32), lp, tk, budget=4)  # unbatched arrays
    with pytest.raises(ValueError):
        build_tree_numpy(0, lp, tk, 0)


def test_builder_choice_by_backend(monkeypatch):
    """The pop loop serves only the CPU (top2gap, or pops <= depth); a GPU always sorts."""
    assert _statics(256, "top2gap", 15, 7)["loop"]
    assert _statics(16, "accum_logp", 15, 7)["loop"]
    assert not _statics(256, "accum_logp", 15, 7)["loop"]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for method in ("top2gap", "accum_logp"):
        for budget in (16, 64, 256):
            assert not _statics(budget, method, 15, 7)["loop"], (method, budget)
