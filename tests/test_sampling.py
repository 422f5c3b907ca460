"""Speculative sampling follows the target's distribution.

For a fixed tiny model the exact distribution of the first three generated tokens is
enumerated from the target's (filtered) conditionals. Autoregressive and speculative samples
(4000 sequences each, one batch) are each compared with it by a chi-square goodness-of-fit
test at significance 1e-3: a correct sampler fails a given check with probability 0.1%
(the seeds are fixed, so the suite is deterministic).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from helpers import loop_args, tiny_head, tiny_target
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.sampling import Sampler, filtered_logits
from jetspec_jax.decode.speculative import TreeSpec, spec_generate
from jetspec_jax.model import target

NUM = 4000
NEW = 3
ALPHA = 1e-3
PROMPT = [1, 4, 2, 5]


def exact_distribution(tcfg, tp, sampler):
    """P(y1, y2, y3 | prompt) for every token triple, from full forward passes."""
    v = tcfg.vocab_size
    seqs = np.array([PROMPT + list(t) for t in itertools.product(range(v), repeat=NEW)])
    n, length = seqs.shape
    cache = target.allocate_cache(tcfg, n, length, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length), (n, length))
    hidden, _, _ = target.forward(tp, tcfg, jnp.asarray(seqs), positions, cache,
                                  jnp.zeros((n,), jnp.int32))
    logits = target.lm_head(tp, tcfg, hidden)[:, len(PROMPT) - 1:-1]  # [n, NEW, V]
    logp = jax.nn.log_softmax(filtered_logits(logits, sampler), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.asarray(seqs[:, len(PROMPT):, None]), axis=-1)
    probs = np.exp(np.asarray(picked[..., 0].sum(-1), np.float64))
    return probs / probs.sum()  # float32 rounding leaves the total a few ulps off 1


def counts(tokens, vocab):
    idx = np.ravel_multi_index(tuple(np.asarray(tokens[:, :NEW]).T), (vocab,) * NEW)
    return np.bincount(idx, minlength=vocab**NEW)


def chi_square_p(observed, probs):
    keep = probs * observed.sum() >= 5  # pool rare cells so the chi-square law holds
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * observed.sum()
    if exp[-1] == 0:
        assert obs[-1] == 0, "sampled a token sequence of probability zero"
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


def check_speculative_sampling(sampler, tree_spec, key, num_slots=32, with_ar=False,
                               draft=None):
    """Speculative samples with tree_spec (and, with_ar, autoregressive ones) pass the
    chi-square test against the exact distribution, with drafts accepted along the way.
    draft: (config, params) of the drafter; None: a random tiny head.
    num_slots: the cache, as small as the run allows (the prompt, NEW tokens and the working
    slots of 16-node trees fit 32): 4000 sequences make its size most of the run's time."""
    tcfg, tp = tiny_target("dense", seed=11, vocab=5, scale=2.0)
    dcfg, dp = draft or tiny_head(tcfg, block_size=5)
    probs = exact_distribution(tcfg, tp, sampler)
    prompt = jnp.asarray([PROMPT] * NUM, jnp.int32)
    lens = jnp.full((NUM,), len(PROMPT), jnp.int32)
    kw = loop_args(sampler, max_new=NEW, num_slots=num_slots)
    sd, st = spec_generate(tp, dp, prompt, lens, key, tcfg=tcfg, dcfg=dcfg, tree_spec=tree_spec,
                           **kw)
    assert np.asarray(st.accepted).max() >= 2  # drafts were accepted, not only bonus tokens
    outs = [sd]
    if with_ar:
        outs.append(ar_generate(tp, prompt, lens, jax.random.key(1), cfg=tcfg, **kw))
    for out in outs:
        assert chi_square_p(counts(out.tokens, tcfg.vocab_size), probs) > ALPHA


@pytest.mark.parametrize("sampler", [Sampler(temperature=1.0), Sampler(temperature=0.8, top_p=0.7),
                                     Sampler(temperature=1.2, top_k=3)])
def test_speculative_sampling_matches_target_distribution(sampler):
    check_speculative_sampling(sampler, TreeSpec(16, 3), jax.random.key(2), with_ar=True)


def test_chi_square_check_detects_a_wrong_distribution():
    """The check has power: samples from a different temperature are rejected."""
    tcfg, tp = tiny_target("dense", seed=11, vocab=5, scale=2.0)
    probs = exact_distribution(tcfg, tp, Sampler(temperature=1.0))
    prompt = jnp.asarray([PROMPT] * NUM, jnp.int32)
    lens = jnp.full((NUM,), len(PROMPT), jnp.int32)
    wrong = ar_generate(tp, prompt, lens, jax.random.key(1), cfg=tcfg,
                        **loop_args(Sampler(temperature=1.5), max_new=NEW, num_slots=48))
    assert chi_square_p(counts(wrong.tokens, tcfg.vocab_size), probs) < ALPHA
