"""Draft-head checkpoints: the reference's released format (made here with numpy, see
tests/fixtures/make_reference_head.py) and our orbax format, with their errors."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fixtures.make_reference_head import (reference_config, reference_tap_ids,
                                          reference_weights, write_reference_head)
from helpers import loop_args, random_prompts, tiny_head, tiny_target
from safetensors.numpy import save_file

from helpers import tree_equal
from jetspec_jax.decode.autoregressive import ar_generate
from jetspec_jax.draft import head as draft_head
from jetspec_jax.draft.head import default_tap_layers
from jetspec_jax.io.checkpoints import CheckpointError, save_target
from jetspec_jax.io.convert import ConversionError
from jetspec_jax.io.heads import (convert_head, read_any_draft, read_draft_checkpoint,
                                 load_reference_head, save_draft)
from jetspec_jax.decode.speculative import TreeSpec, spec_generate

F32 = jnp.float32


def make_head(tmp_path, name="head", *, weights_fn=None, dtype=np.float32, seed=0, **config):
    """A reference-format head dir; weights_fn(weights) may edit the weights before writing."""
    cfg = reference_config(**config)
    weights = reference_weights(cfg, seed=seed, dtype=dtype)
    if weights_fn is not None:
        weights_fn(weights)
    return write_reference_head(tmp_path / name, cfg, weights)


# --- a numpy transcription of the reference head's forward, from the raw [out, in] weights ---

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):  # x [S, heads, H]; HF rotate_half layout
    h = x.shape[-1]
    angles = positions[:, None] * (1.0 / theta ** (np.arange(0, h, 2) / h))[None]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None]
    rotated = np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
    return x * cos + rotated * sin


def reference_draft_logits(w, cfg, embed, lm_head, taps, anchor):
    """taps [T, k*D] of T committed tokens; the block [anchor, MASK...] sits at positions
    T..T+B-1. Returns logits [B-1, V] of block slots 1..B-1."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    n, kv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    blk, t = cfg["block_size"], taps.shape[0]
    dflash = cfg["dflash_config"]
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[[anchor] + [dflash["mask_token_id"]] * (blk - 1)]
    pos = np.arange(t + blk, dtype=np.float64)
    allowed = (np.arange(t + blk)[None, :] <= (t + np.arange(blk))[:, None]
               if dflash.get("causal_head") else np.ones((blk, t + blk), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = lambda name: w[f"layers.{i}.{name}.weight"]  # noqa: E731
        hid = _rms(x, p("input_layernorm"), eps)
        q = _rms((hid @ p("self_attn.q_proj").T).reshape(blk, n, h), p("self_attn.q_norm"), eps)
        src = np.concatenate([ctx, hid])
        k = _rms((src @ p("self_attn.k_proj").T).reshape(-1, kv, h), p("self_attn.k_norm"), eps)
        v = (src @ p("self_attn.v_proj").T).reshape(-1, kv, h)
        q, k = _rope(q, pos[t:], theta), _rope(k, pos, theta)
        k, v = np.repeat(k, n // kv, axis=1), np.repeat(v, n // kv, axis=1)
        scores = np.einsum("qnh,snh->nqs", q, k) / np.sqrt(h)
        scores = np.where(allowed[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("nqs,snh->qnh", probs, v).reshape(blk, n * h)
        x = x + attn @ p("self_attn.o_proj").T
        hid = _rms(x, p("post_attention_layernorm"), eps)
        gate = hid @ p("mlp.gate_proj").T
        x = x + (gate / (1 + np.exp(-gate)) * (hid @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return _rms(x, w["norm.weight"], eps)[1:] @ lm_head


# --- the reference format -----------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_reference_head_matches_reference_forward(tmp_path, causal):
    """Loaded weights drive our draft head to the logits of the reference's own forward."""
    cfg = reference_config(causal=causal)
    weights = reference_weights(cfg, seed=5)
    dcfg, dp = load_reference_head(write_reference_head(tmp_path / "h", cfg, weights),
                                   dtype=F32)
    assert dcfg.causal is causal and dcfg.tap_layers == (0, 2) and dcfg.mask_token_id == 3
    tcfg, tp = tiny_target()
    dcfg.check_target(tcfg)
    t = 5
    taps = np.random.default_rng(1).standard_normal((t, 2 * 64)).astype(np.float32)
    cache = draft_head.allocate_cache(dcfg, 1, 16, F32)
    cache = draft_head.extend_context(dp, dcfg, cache, jnp.asarray(taps)[None],
                                      jnp.array([t], jnp.int32))
    ours = draft_head.draft_block(dp, dcfg, tp, tcfg, cache, jnp.array([7], jnp.int32))[0]
    want = reference_draft_logits(weights, cfg, np.asarray(tp["embed"], np.float64),
                                  np.asarray(tp["lm_head"], np.float64), taps, 7)
    np.testing.assert_allclose(np.asarray(ours), want, rtol=2e-4, atol=2e-4)


def test_reference_head_drafts_losslessly(tmp_path):
    """Default tap layers (no target_layer_ids), transformers-5 rope_parameters, bf16 file:
    the loaded head drives spec_generate to the autoregressive greedy output."""
    path = make_head(tmp_path, target_layer_ids=None, rope_style="rope_parameters",
                     dtype=ml_dtypes.bfloat16)
    dcfg, dp = read_any_draft(path, target=tiny_target()[0])
    assert {x.dtype for x in jax.tree.leaves(dp)} == {jnp.dtype(jnp.bfloat16)}
    assert dcfg.tap_layers == default_tap_layers(3, 2) == (1, 0)
    assert dcfg.layers.rope_theta == 10_000.0 and dcfg.block_size == 6
    dp = jax.tree.map(lambda x: x.astype(F32), dp)
    tcfg, tp = tiny_target(seed=2)
    prompt, lens = random_prompts(np.random.default_rng(0), 3, 6, tcfg.vocab_size)
    kw = loop_args(max_new=16, num_slots=96)
    ar = ar_generate(tp, prompt, lens, jax.random.key(0), cfg=tcfg, **kw)
    sd, stats = spec_generate(tp, dp, prompt, lens, jax.random.key(0), tcfg=tcfg, dcfg=dcfg,
                              tree_spec=TreeSpec(16, 4), **kw)
    np.testing.assert_array_equal(np.asarray(ar.num_tokens), np.asarray(sd.num_tokens))
    for b, n in enumerate(np.asarray(ar.num_tokens)):
        np.testing.assert_array_equal(np.asarray(ar.tokens[b, :n]), np.asarray(sd.tokens[b, :n]))
    assert np.asarray(stats.rounds).min() >= 1


@pytest.mark.parametrize("num_target,num_draft", [(36, 5), (48, 5), (36, 1), (30, 4), (7, 3),
                                                  (64, 8), (3, 2)])
def test_default_taps_follow_the_reference_rule(num_target, num_draft):
    """A head without target_layer_ids taps one layer per draft layer, as the reference's
    build_target_layer_ids(num_target_layers, num_hidden_layers) does."""
    cfg = reference_config(target_layer_ids=None, num_layers=num_draft,
                           num_target_layers=num_target)
    assert default_tap_layers(num_target, num_draft) == tuple(reference_tap_ids(cfg))
    assert default_tap_layers(36, 5) == (1, 9, 17, 25, 33)


# --- our format ---------------------------------------------------------------------------

@pytest.mark.parametrize("mask_token_id,dtype", [(None, F32), (3, jnp.bfloat16)])
def test_save_load_round_trip(tmp_path, mask_token_id, dtype):
    tcfg, _ = tiny_target()
    dcfg, dp = tiny_head(tcfg, mask_token_id=mask_token_id, causal=mask_token_id is None)
    dp = jax.tree.map(lambda x: x.astype(dtype), dp)
    save_draft(tmp_path / "d", dp, dcfg, metadata={"note": "hi"})
    dcfg2, dp2 = read_draft_checkpoint(tmp_path / "d")
    assert dcfg2 == dcfg and ("mask_embed" in dp2) == (mask_token_id is None)
    tree_equal(dp2, dp)
    tree_equal(read_any_draft(tmp_path / "d")[1], dp)
    _, cast = read_draft_checkpoint(tmp_path / "d", dtype=F32)
    tree_equal(cast, jax.tree.map(lambda x: x.astype(F32), dp))
    assert json.loads((tmp_path / "d" / "metadata.json").read_text())["note"] == "hi"


def test_default_tree_is_the_heads_measured_best(tmp_path, monkeypatch):
    """The tree the head's evaluation measured fastest per machine gives the defaults; what it
    leaves out and a head without one get the machine's defaults; an older card's best_budget
    still reads; a bad entry is refused by name."""
    from jetspec_jax import api
    from jetspec_jax.io.load import read_draft

    tcfg, _ = tiny_target()
    dcfg, dp = tiny_head(tcfg)
    save_draft(tmp_path / "d", dp, dcfg, metadata={"evaluation": {"best_tree": {
        "h200": {"budget": 16}, "cpu": {"budget": 2, "width": 1, "ngram": 3}}}})
    save_draft(tmp_path / "plain", dp, dcfg)
    save_draft(tmp_path / "old", dp, dcfg,
               metadata={"evaluation": {"best_budget": {"h200": 32, "cpu": 8}}})
    measured, plain = read_draft(tmp_path / "d"), read_draft(tmp_path / "plain")
    assert plain.best_tree == {}
    assert read_draft(tmp_path / "old").best_tree == {"h200": {"budget": 32}, "cpu": {"budget": 8}}
    assert api.default_tree(measured) == {"budget": 2, "width": 1, "ngram": 3}
    assert api.default_tree(plain) == {"budget": 4, "width": 7, "ngram": 0}
    spec = api.decoding_options(draft=measured).tree_spec
    assert (spec.budget, spec.width, spec.ngram) == (2, 1, 3)
    spec = api.decoding_options(budget=5, width=3, ngram=0, draft=measured).tree_spec
    assert (spec.budget, spec.width, spec.ngram) == (5, 3, 0)  # what the caller gives wins
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    assert api.default_tree(measured) == {"budget": 16, "width": 7, "ngram": 0}
    assert api.default_budget(plain) == 64 and api.default_budget() == 64
    for bad, says in (({"budget": 0}, "budget must be in"), ({"width": 0}, "width must be"),
                      ({"ngram": -1}, "chain length must be"), ({"depth": 3}, "got"),
                      ({"width": "2"}, "got"), (4, "got")):
        meta = json.loads((tmp_path / "d" / "metadata.json").read_text())
        meta["evaluation"]["best_tree"]["cpu"] = bad
        (tmp_path / "plain" / "metadata.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=r"evaluation.best_tree\['cpu'\] must hold "
                           r"whole numbers.*" + says):
            read_draft(tmp_path / "plain")


def test_shipped_heads_default_tree_is_its_fastest_measured():
    """The shipped head's evaluation has the figures its model card gives, and the default
    tree of each machine it was timed on is the fastest of the batch-1 runs recorded there."""
    from jetspec_jax.io.load import read_draft

    head = Path(__file__).parents[1] / "checkpoints" / "smollm2-135m-jetspec"
    evaluation = json.loads((head / "metadata.json").read_text())["evaluation"]
    assert set(evaluation["tau"]) == {"humaneval", "math500", "mtbench"}
    assert evaluation["max_new_tokens"] in (64, 512)  # the answers' cap the figures hold at
    machines = {"h200_bf16": "h200", "cpu_f32": "cpu"}
    assert set(evaluation["batch1"]) <= set(machines) and evaluation["batch1"]
    assert set(evaluation["best_tree"]) == {machines[runs] for runs in evaluation["batch1"]}
    for runs in evaluation["batch1"]:
        machine = machines[runs]
        fastest = max(evaluation["batch1"][runs], key=lambda r: r["speedup"])
        measured = {"width": 7, "ngram": 0} | fastest  # the runs give what is not a default
        assert {"width": 7, "ngram": 0} | evaluation["best_tree"][machine] == {
            k: measured[k] for k in ("budget", "width", "ngram")}
        assert evaluation["speedup"][f"{runs}_batch1"] == round(fastest["speedup"], 3)
    assert read_draft(head).best_tree == evaluation["best_tree"]


def test_checkpoint_saved_on_another_device_loads_here(tmp_path):
    """orbax records each array's device; a head trained on a GPU must load on a CPU."""
    tcfg, _ = tiny_target()
    dcfg, dp = tiny_head(tcfg)
    save_draft(tmp_path / "d", dp, dcfg)
    stored = tmp_path / "d" / "params" / "_sharding"
    text = stored.read_text()
    assert "cpu:0" in text  # the device recorded at save time
    stored.write_text(text.replace("cpu:0", "cuda:0"))
    tree_equal(read_draft_checkpoint(tmp_path / "d")[1], dp)


def test_reference_to_ours_round_trip(tmp_path):
    src = make_head(tmp_path, "ref", dtype=ml_dtypes.bfloat16)
    dcfg, dp = load_reference_head(src)
    convert_head(src, tmp_path / "ours")
    dcfg2, dp2 = read_draft_checkpoint(tmp_path / "ours")
    assert dcfg2 == dcfg
    tree_equal(dp2, dp)
    meta = json.loads((tmp_path / "ours" / "metadata.json").read_text())
    assert meta["kind"] == "draft_head" and meta["source"] == str(src)
    # One of ours converts too: a float32 head stored in bfloat16 (how a trained head ships).
    convert_head(tmp_path / "ours", tmp_path / "ours-f32", dtype=jnp.float32,
                 metadata={"steps": 3})
    convert_head(tmp_path / "ours-f32", tmp_path / "ours-bf16", dtype=jnp.bfloat16)
    meta = json.loads((tmp_path / "ours-bf16" / "metadata.json").read_text())
    assert meta["steps"] == 3 and meta["source"] == str(tmp_path / "ours-f32")  # kept, updated
    _, dp3 = read_draft_checkpoint(tmp_path / "ours-bf16")
    assert {x.dtype for x in jax.tree.leaves(dp3)} == {jnp.dtype(jnp.bfloat16)}
    tree_equal(dp3, jax.tree.map(lambda x: x.astype(jnp.bfloat16), dp))


def test_failed_save_leaves_nothing(tmp_path):
    tcfg, _ = tiny_target()
    dcfg, dp = tiny_head(tcfg)
    dst = tmp_path / "d"
    with pytest.raises(TypeError):  # fails after the arrays are written, before the rename
        save_draft(dst, dp, dcfg, metadata={"bad": object()})
    assert list(tmp_path.iterdir()) == []
    bad = dict(dp, fc=dp["fc"][:, :3])
    with pytest.raises(ValueError, match=r"shape mismatch fc: expected \(128, 64\)"):
        save_draft(dst, bad, dcfg)
    assert list(tmp_path.iterdir()) == []
    save_draft(dst, dp, dcfg)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_draft(dst, dp, dcfg)
    with pytest.raises(TypeError):  # a failed overwrite keeps the old checkpoint
        save_draft(dst, jax.tree.map(jnp.zeros_like, dp), dcfg, metadata={"bad": object()},
                   overwrite=True)
    tree_equal(read_draft_checkpoint(dst)[1], dp)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


# --- errors -------------------------------------------------------------------------------

def test_missing_paths(tmp_path):
    for load in (load_reference_head, read_draft_checkpoint, read_any_draft):
        with pytest.raises(FileNotFoundError, match="no (draft head|checkpoint directory) at"):
            load(tmp_path / "nope")
    head = make_head(tmp_path)
    (head / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_reference_head(head)
    with pytest.raises(CheckpointError, match="cannot tell what"):
        read_any_draft(head)
    head = make_head(tmp_path, "h2")
    (head / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights: neither model.safetensors"):
        read_any_draft(head)


def test_not_a_head(tmp_path):
    tcfg, tp = tiny_target()
    save_target(tmp_path / "target", tp, tcfg)
    with pytest.raises(CheckpointError, match="holds a 'target' checkpoint, not 'draft_head'"):
        read_any_draft(tmp_path / "target")
    hf_target = tmp_path / "hf"
    hf_target.mkdir()
    (hf_target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                       "hidden_size": 64}))
    with pytest.raises(CheckpointError, match="is not a draft-head checkpoint"):
        read_any_draft(hf_target)
    with pytest.raises(CheckpointError, match="not a checkpoint: no metadata.json"):
        read_draft_checkpoint(make_head(tmp_path))  # the reference format is not ours
    (hf_target / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_reference_head(hf_target)


def test_tensor_problems_are_all_reported(tmp_path):
    def edit(w):
        del w["layers.1.mlp.up_proj.weight"], w["fc.weight"], w["norm.weight"]
        w["hidden_norm.weight"] = np.ones(32, np.float32)
        w["layers.0.self_attn.q_proj.weight"] = np.zeros((64, 65), np.float32)
        w["layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
        w["layers.2.input_layernorm.weight"] = np.ones(64, np.float32)
        w["lm_head.weight"] = np.zeros((16, 64), np.float32)

    with pytest.raises(ConversionError) as e:
        load_reference_head(make_head(tmp_path, weights_fn=edit))
    msg = str(e.value)
    for line in [
        "missing tensor fc (fc.weight)",
        "shape mismatch hidden_norm.weight: expected (64,), got (32,)",
        "missing tensor norm (norm.weight)",
        "missing tensor layers/1/up (layers.1.mlp.up_proj.weight)",
        "shape mismatch layers.0.self_attn.q_proj.weight: expected (64, 64), got (64, 65)",
        "unexpected tensor layers.0.self_attn.q_proj.bias",
        "unexpected tensor layers.2.input_layernorm.weight (no layers/2/attn_norm in the config)",
        "unexpected tensor lm_head.weight",
    ]:
        assert line in msg, (line, msg)
    assert "embed" not in msg.replace("embedding", "")


@pytest.mark.parametrize("edit,match", [
    (lambda w: w.pop("layers.0.self_attn.k_norm.weight"),
     r"missing tensor layers/0/k_norm \(layers.0.self_attn.k_norm.weight\)"),
    (lambda w: w.update({"extra.weight": np.ones(3, np.float32)}), "unexpected tensor extra"),
    (lambda w: w.update({"fc.weight": np.ones((64, 192), np.float32)}),
     r"shape mismatch fc.weight: expected \(64, 128\), got \(64, 192\)"),
])
def test_single_tensor_problem(tmp_path, edit, match):
    with pytest.raises(ConversionError, match=match):
        load_reference_head(make_head(tmp_path, weights_fn=edit))


@pytest.mark.parametrize("changes,match", [
    (dict(mask_token_id=None), "missing mask token"),
    (dict(target_layer_ids=(0, 5)), r"target_layer_ids \[5\] are outside the 3 target layers"),
    (dict(target_layer_ids=()), "target_layer_ids must be a non-empty list"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(attention_bias=True), "biases are not supported"),
    (dict(num_key_value_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True,
          sliding_window=4), "sliding-window attention is not supported"),
    (dict(layer_types=None, use_sliding_window=True, sliding_window=4, max_window_layers=1),
     "sliding-window attention is not supported"),
    (dict(num_layers=1, block_size=1), "block_size must be >= 2"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "only default rope"),
])
def test_bad_reference_config(tmp_path, changes, match):
    cfg = reference_config(**changes)
    head = write_reference_head(tmp_path / "h", cfg, reference_weights(reference_config()))
    with pytest.raises(CheckpointError, match=match):
        read_any_draft(head)


def test_bad_reference_config_keys(tmp_path):
    for key, match in [("head_dim", "no head_dim"), ("block_size", "no block_size"),
                       ("num_target_layers", "no num_target_layers")]:
        cfg = reference_config()
        del cfg[key]
        head = write_reference_head(tmp_path / key, cfg, reference_weights(reference_config()))
        with pytest.raises(CheckpointError, match=match):
            load_reference_head(head)
    cfg = reference_config()
    cfg["dflash_config"]["target_hidden_size"] = 128
    with pytest.raises(CheckpointError, match="hidden-size adapter is not supported"):
        load_reference_head(write_reference_head(tmp_path / "th", cfg,
                                                 reference_weights(reference_config())))


def test_head_target_mismatch(tmp_path):
    tcfg, _ = tiny_target()
    narrow = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=48)
    dcfg, _ = load_reference_head(make_head(tmp_path, "narrow", **narrow))
    with pytest.raises(ValueError, match="head hidden size 32 != target hidden size 64"):
        dcfg.check_target(tcfg)
    with pytest.raises(ValueError, match="head hidden size 32 != target hidden size 64"):
        read_any_draft(tmp_path / "narrow", target=tcfg)
    dcfg, _ = load_reference_head(make_head(tmp_path, "deep", num_target_layers=6,
                                            target_layer_ids=(1, 5)))
    with pytest.raises(ValueError) as e:
        dcfg.check_target(tcfg)
    assert "made for a 6-layer target, this target has 3 layers" in str(e.value)
    assert "tap layers [5] are outside the target's 0..2" in str(e.value)
    dcfg, _ = load_reference_head(make_head(tmp_path, "vocab", vocab_size=32, mask_token_id=20))
    with pytest.raises(ValueError) as e:
        dcfg.check_target(tcfg)
    assert "head vocab size 32 != target vocab size 16" in str(e.value)
    assert "mask token id 20 is outside the target vocab of 16" in str(e.value)
    no_vocab = reference_config()
    del no_vocab["vocab_size"]
    dcfg, _ = load_reference_head(write_reference_head(tmp_path / "nv", no_vocab))
    dcfg.check_target(tcfg)  # an unknown head vocab is not checked
    dataclasses.replace(dcfg, tap_layers=(0, 1)).check_target(tcfg)


def test_corrupt_own_checkpoint(tmp_path):
    tcfg, _ = tiny_target()
    dcfg, dp = tiny_head(tcfg)
    save_draft(tmp_path / "d", dp, dcfg)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps(dict(config, tap_layers=[0, 1, 2])))
    with pytest.raises(ValueError, match=r"mismatch fc: expected \(192, 64\), got \(128, 64\)"):
        read_draft_checkpoint(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps(dict(config, wings=2)))
    with pytest.raises(CheckpointError, match="not a valid draft-head config"):
        read_draft_checkpoint(tmp_path / "d")


def test_sharded_reference_head(tmp_path):
    """An index + shards, as save_pretrained writes for a large head."""
    cfg = reference_config()
    weights = reference_weights(cfg, seed=3)
    root = tmp_path / "sharded"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    keys = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: weights[k] for k in part}, str(root / name))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _, sharded = load_reference_head(root, dtype=F32)
    _, single = load_reference_head(write_reference_head(tmp_path / "single", cfg, weights))
    tree_equal(sharded, single)
