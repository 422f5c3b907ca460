"""The EAGLE-style baseline (`lab/`): it plugs into the core's speculative round and trainer by
registration; its training forward equals its inference, greedy speculative decoding with it
equals autoregressive decoding, and it trains, saves, converts and resumes like a block head."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_train
from helpers import loop_args, random_prompts, tiny_target
from jetspec_jax.decode.autoregressive import ar_generate, prefill
from jetspec_jax.decode.speculative import TreeSpec, spec_generate
from jetspec_jax.io.checkpoints import read_info
from jetspec_jax.model import target
from jetspec_jax.model.params import init_params
from jetspec_jax.train.head_forward import target_pass
from lab import eagle, eagle_training as T
from lab.__main__ import run as lab_command
from test_train import dataset, tiny  # noqa: F401  (the fixtures: the same data)


def test_loss_decreases_and_head_is_saved(tiny, dataset, tmp_path):
    """`test_train.py`'s test of the block heads, for the head kind "eagle"."""
    test_train.test_loss_decreases_and_head_is_saved(tiny, dataset, tmp_path, "eagle")


def test_the_lab_command_trains_the_lab_heads(tiny, dataset, tmp_path, capsys):
    """`python -m lab train-draft --head eagle` is the `jetspec` command with "eagle" among the
    heads; `jetspec` itself knows the block heads only."""
    from jetspec_jax.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-draft", "--data", ".", "--out", ".", "--head", "eagle"])
    assert "invalid choice: 'eagle'" in capsys.readouterr().err
    args = build_parser(("eagle",)).parse_args(["train-draft", "--data", ".", "--out", ".",
                                                "--head", "eagle"])
    assert args.head == "eagle"


def test_the_prefill_chunk_is_a_static_argument_of_the_eagle_decoder():
    """`test_prefill.py`'s test of the decoders, for the EAGLE-style head."""
    tcfg, tp = tiny_target("dense", vocab=12)
    ecfg = eagle.eagle_config_for(tcfg, num_taps=2, depth=3)
    ep = init_params(eagle.eagle_specs(ecfg), jax.random.key(2))
    prompt, lens = random_prompts(np.random.default_rng(0), 2, 9, tcfg.vocab_size)
    kw = dict(max_new=4, num_slots=40)

    def fn(c):
        return spec_generate.lower(tp, ep, prompt, lens, jax.random.key(0), tcfg=tcfg, dcfg=ecfg,
                                   tree_spec=TreeSpec(8, 3), **loop_args(prefill_chunk=c, **kw))

    one_pass, chunked = fn(64).as_text(), fn(4).as_text()
    assert one_pass != chunked
    assert chunked == fn(4).as_text()


def eagle_head(tcfg, depth=4, seed=1):
    ecfg = eagle.eagle_config_for(tcfg, num_taps=2, depth=depth)
    return ecfg, init_params(eagle.eagle_specs(ecfg), jax.random.key(seed))


def test_cli_converts_an_eagle_head_to_bfloat16(tmp_path, capsys):
    """`python -m lab convert --head` casts an EAGLE-style head (its kind's `convert`)."""

    tcfg, _ = tiny_target("dense", seed=2, vocab=16)
    ecfg, ep = eagle_head(tcfg)
    T.save_eagle(tmp_path / "f32", ep, ecfg, metadata={"steps": 7})
    assert lab_command(["convert", "--head", str(tmp_path / "f32"), str(tmp_path / "bf16"),
                 "--dtype", "bfloat16"]) == 0
    ecfg2, ep2 = T.load_eagle(tmp_path / "bf16")
    assert ecfg2 == ecfg
    for a, b in zip(jax.tree.leaves(ep), jax.tree.leaves(ep2)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16), np.float32),
                                      np.asarray(b, np.float32))
    assert read_info(tmp_path / "bf16")[1]["steps"] == 7


@pytest.mark.parametrize("kind", ["dense", "llama"])
def test_eagle_training_forward_equals_inference(kind):
    """The unrolled training chain scores the head's own greedy inference chain (a width-1
    tree) with the same cumulative log-probs."""
    tcfg, tp = tiny_target(kind, seed=2, vocab=16)
    ecfg, ep = eagle_head(tcfg)
    d, a = ecfg.depth, 9
    prefix = jax.random.randint(jax.random.key(3), (2, a + 1), 0, tcfg.vocab_size)  # anchor last

    @jax.jit
    def inference(prefix):  # prompt 0..a-1, then a round with the anchor at a
        tcache = target.allocate_cache(tcfg, 2, 32, jnp.float32)
        _, _, ptaps = prefill(tp, tcfg, prefix[:, :a], jnp.full((2,), a), tcache,
                              taps=ecfg.tap_layers)
        ecache = eagle.prompt_context(ep, ecfg, tp, ptaps, prefix[:, :a], jnp.full((2,), a), 32)
        ecache, hid = eagle.extend(ep, ecfg, tp, ecache, ptaps[:, -1:], prefix[:, a:],
                               jnp.ones((2,), jnp.int32))
        return eagle.draft_tree(ep, ecfg, tp, tcfg, ecache, hid[:, 0], prefix[:, a], budget=d + 1,
                            width=1)

    @jax.jit
    def training(tokens):
        _, taps = target_pass(tp, tcfg, tokens, ecfg.tap_layers)
        return T.eagle_logits(ep, ecfg, tp, tcfg, taps, tokens, jnp.full((2, 1), a))[:, 0]

    tree = inference(prefix)
    np.testing.assert_array_equal(tree.depths, np.arange(d + 1)[None].repeat(2, 0))
    logits = training(jnp.concatenate([prefix, tree.tokens[:, 1:]], axis=1))  # + the chain
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits), tree.tokens[:, 1:, None], -1)
    np.testing.assert_allclose(jnp.cumsum(chosen[..., 0], -1), tree.scores[:, 1:], atol=1e-5)


@pytest.mark.parametrize("kind,budget,width,depth", [("dense", 16, 3, None), ("llama", 40, 4, None),
                                                    ("dense", 8, 3, 2)])
def test_eagle_greedy_speculative_equals_autoregressive(kind, budget, width, depth):
    """Also with a shallower tree than the head was made for (depth: its weights do not
    depend on the depth, so a round may draft fewer)."""
    tcfg, tp = tiny_target(kind, seed=3, vocab=6)
    ecfg, ep = eagle_head(tcfg)
    ecfg = dataclasses.replace(ecfg, depth=depth or ecfg.depth)
    prompt, lens = random_prompts(np.random.default_rng(0), 3, 6, tcfg.vocab_size)
    kw = loop_args(max_new=20, stop_ids=(4,), num_slots=96)
    ar = ar_generate(tp, prompt, lens, jax.random.key(0), cfg=tcfg, **kw)
    out, stats = spec_generate(tp, ep, prompt, lens, jax.random.key(0), tcfg=tcfg, dcfg=ecfg,
                               tree_spec=TreeSpec(budget, width), **kw)
    np.testing.assert_array_equal(ar.num_tokens, out.num_tokens)
    for b, n in enumerate(np.asarray(ar.num_tokens)):
        np.testing.assert_array_equal(ar.tokens[b, :n], out.tokens[b, :n])
    assert np.asarray(stats.accepted).max() >= min(budget, 2)  # multi-token rounds happen


@pytest.mark.parametrize("spec", [TreeSpec(8, 2, buckets=(4, 8), bucket_costs=(1.0, 1.5))])
def test_eagle_refuses_what_its_own_tree_cannot_do(spec):
    """The round's adaptive budget is the block head's: asked of the EAGLE-style head it fails
    while tracing, naming why."""
    tcfg, tp = tiny_target("dense", seed=3, vocab=6)
    ecfg, ep = eagle_head(tcfg)
    prompt, lens = random_prompts(np.random.default_rng(0), 2, 4, tcfg.vocab_size)
    with pytest.raises(ValueError, match="EAGLE-style head grows its own tree"):
        spec_generate.trace(tp, ep, prompt, lens, jax.random.key(0), tcfg=tcfg, dcfg=ecfg,
                            tree_spec=spec, **loop_args(max_new=4, num_slots=64))
