"""Lossless greedy speculative decoding: token-identical to autoregressive decoding (float32)."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import loop_args, random_prompts, tiny_head, tiny_target
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import TreeSpec, spec_generate

MAX_NEW = 24
SLOTS = 320
GREEDY = Sampler()


def run_both(tcfg, tp, dcfg, dp, prompt, lens, tree_spec, stop_ids=(), max_new=MAX_NEW,
             **static):
    kw = loop_args(GREEDY, max_new=max_new, stop_ids=stop_ids, num_slots=SLOTS, **static)
    ar = ar_generate(tp, prompt, lens, jax.random.key(0), cfg=tcfg, **kw)
    sd, stats = spec_generate(tp, dp, prompt, lens, jax.random.key(0), tcfg=tcfg, dcfg=dcfg,
                              tree_spec=tree_spec, **kw)
    return ar, sd, stats


def assert_same(ar, sd):
    np.testing.assert_array_equal(np.asarray(ar.num_tokens), np.asarray(sd.num_tokens))
    for b, n in enumerate(np.asarray(ar.num_tokens)):
        np.testing.assert_array_equal(np.asarray(ar.tokens[b, :n]), np.asarray(sd.tokens[b, :n]))


def check_stats(sd, stats):
    accepted = np.asarray(stats.accepted)
    rounds = np.asarray(stats.rounds)
    for b in range(accepted.shape[0]):
        per_round = accepted[b, : rounds[b]]
        assert (per_round >= 1).all()
        # Every round commits its accepted tokens; the output may cut the last round short.
        assert 1 + per_round.sum() >= int(sd.num_tokens[b])


CASES = [
    # (target kind, budget, width, method, block size, causal, mask token id or learned)
    ("dense", 1, 7, "accum_logp", 6, True, None),
    ("dense", 4, 2, "accum_logp", 4, True, 3),
    ("dense", 16, 7, "top2gap", 8, True, None),
    ("dense", 64, 7, "accum_logp", 8, False, 3),
    ("moe", 64, 3, "accum_logp", 6, True, None),
    ("llama", 256, 7, "accum_logp", 16, True, 3),
    ("dense", 8, 1, "chain", 8, True, None),
    ("llama", 16, 4, "top2gap", 5, False, None),
]


@pytest.mark.parametrize("kind,budget,width,method,block,causal,mask_id", CASES)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_greedy_speculative_equals_autoregressive(kind, budget, width, method, block, causal,
                                                  mask_id, seed):
    # A 256-node tree's round is the slow one: half the new tokens still run ~10 rounds each.
    check_greedy_case(kind, TreeSpec(budget, width, method), block, causal, mask_id, seed,
                      max_new=MAX_NEW // 2 if budget >= 256 else MAX_NEW)


def check_greedy_case(kind, spec, block, causal, mask_id, seed, max_new=MAX_NEW):
    """A random tiny target and head (from seed), 3 ragged prompts: greedy SD with spec equals
    AR token for token and its stats add up. -> stats."""
    rng = np.random.default_rng(seed)
    tcfg, tp = tiny_target(kind, seed=seed % 5, vocab=12)
    dcfg, dp = tiny_head(tcfg, seed=seed % 3 + 7, block_size=block, causal=causal,
                         mask_token_id=mask_id)
    prompt, lens = random_prompts(rng, 3, 7, tcfg.vocab_size)
    ar, sd, stats = run_both(tcfg, tp, dcfg, dp, prompt, lens, spec, max_new=max_new)
    assert_same(ar, sd)
    check_stats(sd, stats)
    return stats


def test_stop_tokens_and_acceptance_happen():
    """With a small vocab the random head's top-k often holds the target's choice, so trees
    accept several tokens per round; output still matches, stop tokens included."""
    tcfg, tp = tiny_target("dense", seed=3, vocab=6)
    dcfg, dp = tiny_head(tcfg, block_size=8)
    rng = np.random.default_rng(0)
    prompt, lens = random_prompts(rng, 4, 6, tcfg.vocab_size)
    ar, sd, stats = run_both(tcfg, tp, dcfg, dp, prompt, lens, TreeSpec(64, 4), stop_ids=(5,))
    assert_same(ar, sd)
    assert np.asarray(stats.accepted).max() >= 3  # multi-token rounds were exercised


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), size=st.integers(2, 11), budget=st.sampled_from([4, 16, 64]))
def test_draft_vocabulary_stays_lossless(seed, size, budget):
    """A head that drafts only some token ids (a draft vocabulary: any subset of the target's)
    still gives AR's tokens, and its logits have one column per draft id."""
    import dataclasses

    from jetspec_jax.draft import head as draft_head

    rng = np.random.default_rng(seed)
    tcfg, tp = tiny_target("dense", seed=seed % 5, vocab=12)
    dcfg, dp = tiny_head(tcfg, seed=seed % 3 + 7, block_size=6)
    ids = tuple(sorted(rng.choice(tcfg.vocab_size, size, replace=False).tolist()))
    dcfg = dataclasses.replace(dcfg, draft_vocab=ids)
    dcfg.check_target(tcfg)
    prompt, lens = random_prompts(rng, 3, 7, tcfg.vocab_size)
    ar, sd, stats = run_both(tcfg, tp, dcfg, dp, prompt, lens, TreeSpec(budget, min(4, size)))
    assert_same(ar, sd)
    check_stats(sd, stats)
    cache = draft_head.allocate_cache(dcfg, 1, 16, tp["embed"].dtype)
    logits = draft_head.draft_block(dp, dcfg, tp, tcfg, cache, prompt[:1, 0])
    assert logits.shape == (1, dcfg.depth, size)


def test_draft_vocabulary_is_checked():
    import dataclasses

    tcfg, _ = tiny_target("dense", seed=0, vocab=12)
    dcfg, _ = tiny_head(tcfg)
    outside = "must lie in the target vocab"
    for ids, why in (((3, 12), outside), ((), outside), ((1, 1), "repeat")):
        with pytest.raises(ValueError, match=why):
            dataclasses.replace(dcfg, draft_vocab=ids).check_target(tcfg)
