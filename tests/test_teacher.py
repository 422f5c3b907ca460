"""The stored teacher: the two-stage top-K equals `jax.lax.top_k`, and labelling a data set in
batches of any size equals the target's own top-K at every position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import tiny_target
from jetspec_jax.model import target
from jetspec_jax.train.head_forward import target_pass
from jetspec_jax.model.layers import exact_top_k
from jetspec_jax.train import teacher
from jetspec_jax.train.teacher import (batch_shapes, compile_ahead, label_top_k, top_k_teacher,
                                        width_batches)


@settings(max_examples=12, deadline=None)
@given(groups=st.integers(1, 40), group=st.sampled_from([1, 4, 16]), k=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_two_stage_top_k_is_exact(groups, group, k, seed):
    v = groups * group
    k = min(k, v)
    x = jax.random.normal(jax.random.key(seed), (3, 5, v))  # no ties: the ids are unique
    x = x.at[0, 0].set(x[0, 0] * 50)  # one row far from the others' scale
    want_top, want_ids = jax.lax.top_k(x, k)
    top, ids = exact_top_k(x, k, group)
    np.testing.assert_array_equal(top, want_top)
    np.testing.assert_array_equal(ids, want_ids)


def test_two_stage_top_k_breaks_ties_as_top_k_does():
    """Equal logits in different groups: the lower id comes first, as with `jax.lax.top_k`."""
    x = jax.random.randint(jax.random.key(1), (64, 2048), 0, 40).astype(jnp.float32)
    top, ids = exact_top_k(x, 16, 16)
    want_top, want_ids = jax.lax.top_k(x, 16)
    np.testing.assert_array_equal(top, want_top)
    np.testing.assert_array_equal(ids, want_ids)


def test_two_stage_top_k_runs_where_the_groups_are_many():
    """The concentrated case: the K largest entries all in one group."""
    x = jnp.zeros((2, 4096)).at[:, 640:648].set(jnp.arange(8.0) + 1)
    top, ids = exact_top_k(x, 8, 128)
    np.testing.assert_array_equal(ids, np.tile(np.arange(647, 639, -1), (2, 1)))
    np.testing.assert_array_equal(top, np.tile(np.arange(8.0, 0, -1), (2, 1)))
    logp, ids2 = top_k_teacher(x, 8)
    np.testing.assert_allclose(logp, top - jax.nn.logsumexp(x, -1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(ids2, ids)


@pytest.mark.parametrize("batch_tokens,bucket", [(8, 4), (40, 8), (1000, 16)])
def test_labels_equal_the_targets_top_k_at_every_position(batch_tokens, bucket):
    tcfg, tp = tiny_target(vocab=64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, tcfg.vocab_size, (7, 20)).astype(np.int32)
    lengths = np.array([20, 3, 11, 1, 16, 20, 8], np.int32)
    timing = {}
    got = label_top_k(tp, tcfg, tokens, lengths, 5, batch_tokens=batch_tokens, bucket=bucket,
                      timing=timing)
    again = {}  # every width compiled by the first call: the second compiles nothing
    label_top_k(tp, tcfg, tokens, lengths, 5, batch_tokens=batch_tokens, bucket=bucket,
                timing=again)
    assert timing["compile_seconds"] > 0 and again == {}
    hidden, _ = target_pass(tp, tcfg, jnp.asarray(tokens), ())
    want_logp, want_ids = top_k_teacher(target.lm_head(tp, tcfg, hidden), 5)
    for r, m in enumerate(lengths):
        np.testing.assert_allclose(got["top_logp"][r, :m], want_logp[r, :m], atol=2e-5)
        np.testing.assert_array_equal(got["top_ids"][r, :m], want_ids[r, :m])
        assert not got["top_logp"][r, m:].any() and not got["top_ids"][r, m:].any()


def test_programs_compiled_ahead_label_as_those_compiled_in_place():
    """make_dataset starts every width's program compiling while it generates the answers;
    label_top_k then takes them (waiting for any still compiling) and labels as before."""
    tcfg, tp = tiny_target(vocab=48, seed=3)  # a config no other test compiles
    rng = np.random.default_rng(1)
    tokens = rng.integers(2, tcfg.vocab_size, (5, 20)).astype(np.int32)
    lengths = np.array([20, 4, 3, 17, 1], np.int32)  # no width 16: compiled all the same
    compile_ahead(tp, tcfg, 4, 20, batch_tokens=40, bucket=8)
    signature = teacher._signature(tp)
    ahead = [teacher._PROGRAMS[signature, tcfg, 4, s] for s in [(5, 8), (2, 16), (2, 20)]]
    timing = {}
    got = label_top_k(tp, tcfg, tokens, lengths, 4, batch_tokens=40, bucket=8, timing=timing)
    assert all(f.done() and f.exception() is None for f in ahead)  # every width, used or not
    hidden, _ = target_pass(tp, tcfg, jnp.asarray(tokens), ())
    want_logp, want_ids = top_k_teacher(target.lm_head(tp, tcfg, hidden), 4)
    for r, m in enumerate(lengths):
        np.testing.assert_allclose(got["top_logp"][r, :m], want_logp[r, :m], atol=2e-5)
        np.testing.assert_array_equal(got["top_ids"][r, :m], want_ids[r, :m])


def test_width_batches_cover_every_row_once_within_the_token_budget():
    tokens = np.arange(9 * 32, dtype=np.int32).reshape(9, 32)
    lengths = np.array([32, 1, 5, 17, 31, 9, 16, 2, 30])
    seen, shapes = [], []
    for rows, batch in width_batches(tokens, lengths, 40, 8):
        shapes.append(batch.shape)
        width = batch.shape[1]
        assert width % 8 == 0 or width == 32
        assert batch.shape[0] == max(1, 40 // width)
        assert all(lengths[r] <= width < lengths[r] + 8 for r in rows)
        np.testing.assert_array_equal(batch[:len(rows)], tokens[rows, :width])
        assert not batch[len(rows):].any()
        seen += list(rows)
    assert sorted(seen) == list(range(9))
    assert batch_shapes(lengths, 32, 40, 8) == list(dict.fromkeys(shapes))  # compiled ahead
