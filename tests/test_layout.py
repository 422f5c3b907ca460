"""The fused weight layout (`jetspec_jax/model/layout.py`): q/k/v and gate/up concatenated. Same
tokens as the separate layout everywhere the model reads weights (XLA projections, the Pallas
projection kernels, speculative rounds, the API on a mesh), and an exact round trip."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from helpers import count_eqns, loop_args, random_prompts, tiny_head, tiny_target, tree_equal
from jetspec_jax import api
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.decode.speculative import TreeSpec, spec_generate
from jetspec_jax.io.checkpoints import save_target
from jetspec_jax.io.heads import save_draft
from jetspec_jax.model import layout
from jetspec_jax.model.kernels import Kernels
from test_api_cli import PROMPTS, VOCAB, word_tokenizer
from test_speculative import assert_same

KW = dict(num_slots=48)
# The autoregressive references below decode one batch shape (per target kind), so each is
# compiled once: 3 prompts of up to 7 tokens, 10 new tokens.
BATCH, PROMPT_LEN, NEW = 3, 7, 10


@pytest.mark.parametrize("kind", ["dense", "llama", "moe"])
def test_round_trip_and_leaves(kind):
    cfg, params = tiny_target(kind, seed=3)
    fused = layout.fuse_projections(params)
    first = fused["layers"][0]
    assert layout.is_fused(fused) and not layout.is_fused(params)
    # the layout is the weights' type: it survives tree maps and jit, and is static there
    assert layout.is_fused(jax.tree.map(lambda x: x, fused))
    assert bool(jax.jit(lambda p: layout.is_fused(p))(fused))
    assert "qkv" in first and not {"q", "k", "v"} & set(first)
    assert first["qkv"].shape == (cfg.hidden_size,
                                  (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    # experts are chosen per token: a MoE layer keeps its gate and up
    assert ("gate_up" in first) == (kind != "moe") and ("gate" in first) == (kind == "moe")
    tree_equal(layout.fuse_projections(fused), fused)  # fusing twice changes nothing
    tree_equal(layout.split_projections(fused, cfg), params)
    in_place = layout.fuse_projections(params, in_place=True)
    tree_equal(in_place, fused)
    assert in_place["layers"][0] is params["layers"][0]  # rewritten, not copied


@pytest.mark.parametrize("kind", ["dense", "llama", "moe"])
def test_greedy_decode_identical(kind):
    cfg, params = tiny_target(kind, seed=6, vocab=32)
    prompt, lens = random_prompts(np.random.default_rng(4), BATCH, PROMPT_LEN, cfg.vocab_size)
    want = ar_generate(params, prompt, lens, jax.random.key(0), cfg=cfg, **loop_args(max_new=NEW, **KW))
    got = ar_generate(layout.fuse_projections(params), prompt, lens, jax.random.key(0),
                      cfg=cfg, **loop_args(max_new=NEW, **KW))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


@pytest.mark.parametrize("kind,budget,width", [("dense", 8, 3), ("moe", 12, 4),
                                               ("llama", 5, 2)])
def test_speculative_with_fused_weights_equals_autoregressive(kind, budget, width):
    tcfg, tp = tiny_target(kind, seed=8, vocab=32)
    dcfg, dp = tiny_head(tcfg, seed=9, block_size=4)
    prompt, lens = random_prompts(np.random.default_rng(5), BATCH, PROMPT_LEN, tcfg.vocab_size)
    want = ar_generate(tp, prompt, lens, jax.random.key(0), cfg=tcfg, **loop_args(max_new=NEW, **KW))
    got, _ = spec_generate(layout.fuse_projections(tp), dp, prompt, lens, jax.random.key(0),
                           tcfg=tcfg, dcfg=dcfg, tree_spec=TreeSpec(budget, width),
                           **loop_args(max_new=NEW, **KW))
    assert_same(want, got)


def test_pallas_projections_read_the_fused_layout():
    """matmul "pallas_interpret" on fused weights: one kernel for q/k/v and one for gate/up
    (3 fewer a layer than on separate weights), XLA's tokens."""
    cfg, params = tiny_target("dense", seed=5, vocab=32)
    pallas = Kernels(matmul=("pallas", "xla"), interpret=True)
    fused = layout.fuse_projections(params)
    prompt, lens = random_prompts(np.random.default_rng(1), BATCH, PROMPT_LEN, cfg.vocab_size)
    def run(p, kernels):
        return ar_generate(p, prompt, lens, jax.random.key(0), cfg=cfg,
                           **loop_args(max_new=NEW, kernels=kernels, **KW))
    n_fused = count_eqns(lambda p: run(p, pallas).tokens, fused, name="small_m_matmul")
    n_separate = count_eqns(lambda p: run(p, pallas).tokens, params, name="small_m_matmul")
    assert 0 < n_fused < n_separate and (n_separate - n_fused) % (3 * cfg.num_layers) == 0
    np.testing.assert_array_equal(np.asarray(run(fused, pallas).tokens),
                                  np.asarray(run(params, Kernels()).tokens))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    # test_api_cli's target and head shapes, decoded below as there: their programs are shared
    tcfg, tparams = tiny_target("dense", vocab=VOCAB, seed=2)
    dcfg, dparams = tiny_head(tcfg, block_size=6)
    return SimpleNamespace(target=save_target(root / "target", tparams, tcfg,
                                              tokenizer=word_tokenizer()),
                           head=save_draft(root / "head", dparams, dcfg))


def test_load_target_fuses_on_request_and_the_api_decodes_the_same(saved):
    plain = api.load_target(saved.target)  # CPU: the separate layout by default
    fused = api.load_target(saved.target, fuse=True)
    assert not layout.is_fused(plain.params) and layout.is_fused(fused.params)
    want = api.generate(plain, PROMPTS, max_new_tokens=10)
    for target in (fused, plain):
        draft = api.load_draft(saved.head, target)
        got = api.generate(target, PROMPTS, draft=draft, max_new_tokens=10, budget=8)
        assert got.tokens == want.tokens
    # a mesh asks for the separate layout: generate splits a fused target's weights first
    on_mesh = api.generate(fused, PROMPTS, max_new_tokens=10, mesh="tp=1")
    assert on_mesh.tokens == want.tokens
    with pytest.raises(ValueError, match="fuse=True needs one device"):
        api.load_target(saved.target, fuse=True, mesh="tp=1")
