"""The Python API and the `jetspec` CLI on a tiny target saved as our checkpoint (with a
word-level tokenizer), plus one smoke run of the embedded SmolLM2 default; and one test per
row of docs/bad_inputs.md that the API and CLI own."""

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as Backend, models, pre_tokenizers

import jetspec_jax
from fixtures.make_reference_head import reference_config, reference_weights, write_reference_head
from helpers import tiny_head, tiny_target
from jetspec_jax import api
from jetspec_jax.cli import build_parser, main
from jetspec_jax.options import MAX_BUDGET
from jetspec_jax.io import sources
from jetspec_jax.io.checkpoints import save_target
from jetspec_jax.io.convert.hf import load_hf
from jetspec_jax.io.heads import save_draft
from jetspec_jax.io.tokenizer import Tokenizer, TokenizerError

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB = 32
CHAT = ("{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<bot>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %} w9{% endif %}")  # Qwen3's
GPU_ONLY = ("hopper", "portable", "decode", "fused_decode")
AUTO = (4, 8)  # api.AUTO_BUCKETS in the tests: the defaults (up to 256 nodes) compile slowly
PROMPTS = ("w1 w2 w3", "w4")  # most tests' batch, so they share compiled programs
PROMPT_FLAGS = tuple(f for p in PROMPTS for f in ("--prompt", p))  # the same batch on the CLI


def word_tokenizer() -> Tokenizer:
    """<eos> <user> <bot> w0 ... w28: one id per whitespace-separated word."""
    words = ["<eos>", "<user>", "<bot>"] + [f"w{i}" for i in range(VOCAB - 3)]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, chat_template=CHAT, special_tokens={"eos_token": "<eos>"},
                     eos_token_ids=(0,))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Our checkpoints of a tiny target (context limit 512) and of a random head for it."""
    root = tmp_path_factory.mktemp("tiny")
    tcfg, tparams = tiny_target("dense", vocab=VOCAB)
    dcfg, dparams = tiny_head(tcfg, block_size=6)
    return SimpleNamespace(
        target=save_target(root / "target", tparams, tcfg, tokenizer=word_tokenizer()),
        head=save_draft(root / "head", dparams, dcfg), cfg=tcfg)


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_error(capsys, *argv) -> str:
    """Runs a CLI call that must fail cleanly; returns its stderr."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    assert "Traceback" not in err and "\nerror: " in "\n" + err, err  # after any progress bar
    return err[err.index("error: "):]


# ---- API -------------------------------------------------------------------------------------


def test_generate_speculative_matches_autoregressive(tiny):
    target = jetspec_jax.load_target(tiny.target)
    draft = jetspec_jax.load_draft(tiny.head, target)
    r = jetspec_jax.generate(target, PROMPTS, draft=draft, max_new_tokens=10,
                             budget=8, compare_autoregressive=True)
    assert r.mode == "speculative" and r.ar_identical and r.tokens == r.ar_tokens
    # The first token comes from the prefill; the rounds commit the rest (the last maybe cut).
    assert all(1 + sum(a) >= len(t) for a, t in zip(r.accepted, r.tokens))
    assert len(r.tau) == 2 and all(t >= 1 for t in r.tau)
    assert sum(r.tau_hist) == sum(r.rounds) and r.tau_hist[0] == 0
    assert r.tokens_per_s > 0 and r.ar_tokens_per_s > 0 and r.speedup > 0 and r.compile_s > 0
    assert all(set(text.split()) <= {f"w{i}" for i in range(VOCAB)} for text in r.texts)
    json.dumps(r.to_dict())

    # Other prompt lengths in the same bucket reuse the compiled code.
    again = jetspec_jax.generate(target, ["w5 w6", "w7 w8 w9 w10"], draft=draft,
                                 max_new_tokens=10, budget=8)
    assert again.compile_s == 0.0
    ar = jetspec_jax.generate(target, PROMPTS, max_new_tokens=10)
    assert ar.mode == "autoregressive" and ar.tau is None and ar.tokens == r.tokens


def test_generate_token_prompts_and_sampling(tiny):
    target = api.load_target(tiny.target)
    greedy = api.generate(target, [3, 4, 5], max_new_tokens=6, stop_ids=())
    assert len(greedy.tokens) == 1 and len(greedy.tokens[0]) == 6
    assert greedy.tokens == api.generate(target, "w0 w1 w2", chat=False, max_new_tokens=6,
                                         stop_ids=()).tokens
    chunked = api.generate(target, [3, 4, 5], max_new_tokens=6, stop_ids=(), prefill_chunk=2)
    assert chunked.tokens == greedy.tokens and chunked.compile_s > 0  # its own program
    kw = dict(max_new_tokens=6, temperature=1.0, top_k=8, stop_ids=())
    a = api.generate(target, [[3, 4, 5], [6]], seed=1, **kw)
    assert a.tokens == api.generate(target, [[3, 4, 5], [6]], seed=1, **kw).tokens


def test_generate_auto_budget_matches_autoregressive(tiny, monkeypatch):
    """budget="auto" changes only the trees: greedy output stays the autoregressive output;
    auto measures its bucket costs once and reports the sizes chosen (`test_adaptive.py`
    covers it in the decoder)."""
    monkeypatch.setattr(api, "AUTO_BUCKETS", AUTO)
    target = api.load_target(tiny.target)
    draft = api.load_draft(tiny.head, target)
    ar = api.generate(target, PROMPTS, max_new_tokens=10)
    fixed = api.generate(target, PROMPTS, draft=draft, max_new_tokens=10, budget=8)
    assert fixed.tokens == ar.tokens
    assert fixed.bucket_mix == {8: max(fixed.rounds)} and not fixed.tree_spec.buckets
    auto = api.generate(target, PROMPTS, draft=draft, max_new_tokens=10, budget="auto")
    assert auto.tokens == ar.tokens and auto.tree_spec.buckets == AUTO
    assert sum(auto.bucket_mix.values()) == max(auto.rounds) and set(auto.bucket_mix) <= {4, 8}
    assert "budget auto (buckets 4, 8), width 7, tree accum_logp" in auto.summary() \
        and "tree sizes chosen: " in auto.summary()
    json.dumps(auto.to_dict())
    again = api.generate(target, PROMPTS, draft=draft, max_new_tokens=10,
                         budget="auto")  # costs and compiled code reused
    assert again.compile_s == 0.0 and again.tree_spec == auto.tree_spec


def test_default_draft_path(tmp_path, monkeypatch):
    assert api.default_draft_path("tiny-dense") is None
    (tmp_path / "tiny-dense-jetspec").mkdir()
    monkeypatch.setattr(sources, "CHECKPOINT_DIRS", (tmp_path,))
    assert api.default_draft_path("tiny-dense") == tmp_path / "tiny-dense-jetspec"


# ---- CLI -------------------------------------------------------------------------------------


def test_cli_generate_speculative(tiny, capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", tiny.target, "--draft", tiny.head,
                           *PROMPT_FLAGS,
                           "--max-new-tokens", 10, "--budget", 8, "--compare")
    assert code == 0
    assert "=== prompt 1 ===" in out and "speculative: draft" in out and "tau " in out
    assert "tok/s" in out and "speedup" in out and "greedy outputs identical: yes" in out


def test_enable_thinking_reaches_the_chat_template_from_the_api_and_cli(tiny, capsys,
                                                                        monkeypatch):
    target = api.load_target(tiny.target)
    plain, no_thinking = (api.encode_prompts(target, PROMPTS[0], enable_thinking=on)
                          for on in (None, False))
    assert api.encode_prompts(target, PROMPTS[0], enable_thinking=True) == plain
    assert no_thinking == [plain[0] + target.tokenizer.encode("w9")]
    seen, render = [], Tokenizer.chat_text
    monkeypatch.setattr(Tokenizer, "chat_text",
                        lambda self, *a, **kw: seen.append(kw) or render(self, *a, **kw))
    for flag in ([], ["--enable-thinking"], ["--no-enable-thinking"]):
        code, _, err = run_cli(capsys, "generate", "--model", tiny.target, "--no-draft",
                               *PROMPT_FLAGS, "--max-new-tokens", 10, *flag)
        assert code == 0, err
    assert seen == [{}] * 2 + [{"enable_thinking": True}] * 2 + [{"enable_thinking": False}] * 2
    served = {}  # serve: the server's default for requests that do not set it
    monkeypatch.setattr("jetspec_jax.serve.app.serve", lambda *a, **kw: served.update(kw))
    assert main(["serve", "--model", str(tiny.target), "--no-draft", "--max-len", "32",
                 "--no-enable-thinking"]) == 0
    assert served["chat_template_kwargs"] == {"enable_thinking": False}


def test_cli_generate_autoregressive_from_prompt_file(tiny, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    # 5 tokens unchatted, as PROMPTS[0] chatted: the autoregressive program of the tests above.
    prompts.write_text('{"prompt": "w1 w2 w3 w4 w5"}\n\n{"prompt": "w3"}\n')
    code, out, _ = run_cli(capsys, "generate", "--model", tiny.target, "--no-draft",
                           "--prompt-file", prompts, "--no-chat", "--max-new-tokens", 10)
    assert code == 0 and "autoregressive" in out and "=== prompt 1 ===" in out


def test_cli_convert_round_trip(capsys, tmp_path):
    dst = tmp_path / "llama"
    code, out, _ = run_cli(capsys, "convert", FIXTURES / "llama", dst, "--dtype", "float32")
    assert code == 0 and f"wrote {dst}" in out
    target = api.load_target(dst)
    cfg, params = load_hf(FIXTURES / "llama", dtype=jnp.float32, progress=False)
    assert target.cfg == cfg
    for x, y in zip(jax.tree.leaves(target.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert "exists; pass --overwrite" in cli_error(capsys, "convert", FIXTURES / "llama", dst)
    assert run_cli(capsys, "convert", FIXTURES / "llama", dst, "--overwrite")[0] == 0


def test_cli_convert_reference_head(tiny, capsys, tmp_path):
    config = reference_config(vocab_size=VOCAB)
    ref = write_reference_head(tmp_path / "ref", config, reference_weights(config))
    code, out, _ = run_cli(capsys, "convert", "--head", ref, tmp_path / "ours",
                           "--dtype", "float32")
    assert code == 0 and "wrote" in out
    target = api.load_target(tiny.target)
    ours, theirs = api.load_draft(tmp_path / "ours", target), api.load_draft(ref, target)
    assert ours.dcfg == theirs.dcfg
    for x, y in zip(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    code, out, _ = run_cli(capsys, "generate", "--model", tiny.target, "--draft", ref,
                           "--prompt", "w1", "--max-new-tokens", 4, "--budget", 4)
    assert code == 0 and f"speculative: draft {ref}" in out


def test_cli_bench(tiny, capsys, tmp_path):
    out_file = tmp_path / "bench.json"
    code, out, err = run_cli(capsys, "bench", "--model", tiny.target, "--draft", tiny.head,
                             *PROMPT_FLAGS,
                             "--max-new-tokens", 10, "--budgets", 4, 8, "--out", out_file)
    assert code == 0 and "budget" in out and "speedup" in out and "bench" in err  # progress
    rows = json.loads(out_file.read_text())["rows"]
    assert [r["budget"] for r in rows] == [4, 8]
    assert all(r["identical"] and r["tau"] >= 1 and r["speedup"] > 0 for r in rows)


def test_cli_auto_budget(tiny, capsys, tmp_path, monkeypatch):
    args = build_parser().parse_args(["generate", "--budget", "auto"])
    assert args.budget == "auto"
    monkeypatch.setattr(api, "AUTO_BUCKETS", AUTO)
    out_file = tmp_path / "bench.json"  # the shapes of the API test above: compiled code reused
    code, out, _ = run_cli(capsys, "bench", "--model", tiny.target, "--draft", tiny.head,
                           *PROMPT_FLAGS,
                           "--max-new-tokens", 10, "--budgets", 8, "auto", "--out", out_file)
    assert code == 0 and "tree sizes chosen: " in out
    info = json.loads(out_file.read_text())
    assert [r["budget"] for r in info["rows"]] == [8, "auto"]
    assert all(r["identical"] for r in info["rows"])
    assert set(info["rows"][1]["bucket_mix"]) <= {"4", "8"}


def test_cli_generate_default_smollm2(capsys, use_smollm2_cache):
    """No model flags: the embedded SmolLM2-135M-Instruct on the built-in prompt (notebook 01's
    prompt and, in its tiny mode, its length: a test run compiles that program once)."""
    code, out, _ = run_cli(capsys, "generate", "--max-new-tokens", 8)
    assert code == 0 and "tok/s" in out and out.strip().splitlines()[0].strip()


def test_cli_generate_stream(tiny, capsys):
    args = ("generate", "--model", tiny.target, "--draft", tiny.head, "--prompt", "w1 w2 w3",
            "--max-new-tokens", 9, "--budget", 4)
    code, out, _ = run_cli(capsys, *args)
    code_s, streamed, _ = run_cli(capsys, *args, "--stream")
    assert code == code_s == 0 and streamed.split("\n\n")[0] == out.split("\n\n")[0]
    err = cli_error(capsys, *args, "--prompt", "w4", "--stream")
    assert "--stream prints one generation as it is made: give one prompt and no --compare " \
        "(got 2 prompts)" in err
    assert "(got 1 prompts, --compare)" in cli_error(capsys, *args, "--stream", "--compare")


def test_ngram_chains_in_the_api_and_cli(tiny, capsys):
    """--ngram L (ngram= in the API) adds context chains to the head's trees and --draft ngram
    drafts with them alone: greedy output stays AR's, streamed or not."""
    target = api.load_target(tiny.target)
    draft = api.load_draft(tiny.head, target)
    prompts = ("w1 w2 w3 w1 w2 w3 w1 w2", "w4 w5 w4 w5 w4")
    ar = api.generate(target, prompts, max_new_tokens=10)
    for d, ngram in ((draft, 3), (api.ngram_draft(4), 0)):
        r = api.generate(target, prompts, draft=d, budget=8, max_new_tokens=10, ngram=ngram)
        assert r.tokens == ar.tokens and r.tree_spec.ngram == ngram
        streamed = [[] for _ in prompts]
        for chunk in api.stream(target, prompts, draft=d, budget=8, max_new_tokens=10,
                                ngram=ngram):
            for b, ids in enumerate(chunk.tokens):
                streamed[b] += ids
        assert streamed == r.tokens
    assert api.ngram_draft(4).best_tree == {"cpu": {"budget": 5}, "h200": {"budget": 5}}
    for flags, says in ((["--draft", tiny.head, "--ngram", 3], "n-gram chain 3"),
                        (["--draft", "ngram", "--ngram", 4], "draft ngram, budget 8")):
        code, out, _ = run_cli(capsys, "generate", "--model", tiny.target, *PROMPT_FLAGS,
                               "--max-new-tokens", 10, "--budget", 8, "--compare", *flags)
        assert code == 0 and "greedy outputs identical: yes" in out and says in out
    assert "--ngram must be >= 0, got -1" in cli_error(
        capsys, "generate", "--model", tiny.target, "--ngram", -1)
    with pytest.raises(ValueError, match="fixed budget"):
        api.generate(target, prompts, draft=draft, budget="auto", ngram=3)


# ---- bad inputs (docs/bad_inputs.md) ---------------------------------------------------------


def test_bad_missing_paths(tiny, capsys, tmp_path):
    err = cli_error(capsys, "generate", "--model", tmp_path / "nowhere")
    assert "nowhere: no such file or directory; expected a jetspec_jax checkpoint" in err
    err = cli_error(capsys, "generate", "--model", tiny.target, "--draft", tmp_path / "nohead")
    assert "no draft head at" in err and "nohead: no such file or directory" in err
    err = cli_error(capsys, "generate", "--prompt-file", tmp_path / "none.txt")
    assert "no such prompt file:" in err


CUT_ARRAYS = "cannot read the stored arrays (truncated or corrupt checkpoint?)"


@pytest.mark.parametrize("which,cut,message", [
    ("target", "ocdbt.process_0", CUT_ARRAYS),
    ("target", "_METADATA", "does not match the model config:\n  missing tensor embed"),
    ("head", "ocdbt.process_0", CUT_ARRAYS),
], ids=["target-arrays", "target-array-index", "head-arrays"])
def test_bad_truncated_checkpoint(tiny, capsys, tmp_path, which, cut, message):
    broken = tmp_path / "broken"
    shutil.copytree(getattr(tiny, which), broken)
    victim = broken / "params" / cut
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    flags = ["--model", broken, "--no-draft"] if which == "target" else [
        "--model", tiny.target, "--draft", broken]
    err = cli_error(capsys, "generate", *flags)
    assert message in err
    assert message != CUT_ARRAYS or err.count("\n") == 1  # orbax's logged tracebacks silenced


def test_bad_hf_architecture(capsys, tmp_path):
    src = tmp_path / "mistral"
    shutil.copytree(FIXTURES / "llama", src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config,
                                                 "architectures": ["MistralForCausalLM"]}))
    err = cli_error(capsys, "convert", src, tmp_path / "out")
    assert "mistral/config.json: unsupported architecture ['MistralForCausalLM'] (key " \
        "'architectures'); supported:" in err
    assert not (tmp_path / "out").exists()


def test_bad_head_target_mismatch(tiny, capsys, tmp_path):
    other, _ = tiny_target("dense", vocab=VOCAB, hidden_size=32)
    dcfg, dparams = tiny_head(other)
    head = save_draft(tmp_path / "other-head", dparams, dcfg)
    err = cli_error(capsys, "generate", "--model", tiny.target, "--draft", head)
    assert "draft head does not fit the target: head hidden size 32 != target hidden size 64" \
        in err and str(head) in err
    target = api.load_target(tiny.target)
    with pytest.raises(ValueError, match="head hidden size 32 != target hidden size 64"):
        api.generate(target, "w1", draft=api.Draft(dcfg, dparams))


def test_bad_prompt_over_context_limit(tiny, capsys):
    err = cli_error(capsys, "generate", "--model", tiny.target, "--no-draft", "--prompt",
                    "w1 " * 600, "--max-new-tokens", 16)
    assert "prompt 0 has 602 tokens" in err and "context limit of 512 tokens" in err


@pytest.mark.parametrize("budget", [0, MAX_BUDGET + 1])
def test_bad_budget(tiny, capsys, budget):
    err = cli_error(capsys, "generate", "--model", tiny.target, "--draft", tiny.head,
                    "--budget", budget)
    assert f"budget must be in [1, {MAX_BUDGET}], got {budget}" in err


@pytest.mark.parametrize("flags,message", [
    (["generate", "--budget", "big"], "argument --budget: expected a number of tree nodes or "
     "'auto', got 'big'"),
    (["bench", "--budgets", "8", "x"], "argument --budgets: expected a number of tree nodes"),
    (["generate", "--prefill-chunk", "0"], "argument --prefill-chunk: expected a whole number "
     ">= 1, got '0'"),
    (["generate", "--prefill-chunk", "2k"], "argument --prefill-chunk: expected a whole number"),
], ids=["budget", "budgets", "prefill-chunk-0", "prefill-chunk-text"])
def test_bad_budget_and_prefill_chunk_flags(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bad_budget_and_prefill_chunk_in_the_api(tiny):
    target = api.load_target(tiny.target)
    with pytest.raises(ValueError, match="budget must be a number of tree nodes or 'auto', "
                       "got 'big'"):
        api.generate(target, "w1", budget="big")
    for chunk in (0, 2.5):
        with pytest.raises(ValueError, match=f"prefill_chunk must be a whole number >= 1, got "
                           f"{chunk}"):
            api.generate(target, "w1", prefill_chunk=chunk)


def test_bad_prompt_file_not_utf8(capsys, tmp_path):
    file = tmp_path / "latin1.txt"
    file.write_bytes("café\n".encode("latin-1"))
    err = cli_error(capsys, "generate", "--prompt-file", file)
    assert "is not UTF-8 text (byte 0xe9 at offset 3)" in err


@pytest.mark.parametrize("text", ["", "\n  \n"], ids=["empty", "blank"])
def test_bad_prompt_file_empty(capsys, tmp_path, text):
    file = tmp_path / "prompts.txt"
    file.write_text(text)
    assert "holds no prompts (it is empty or blank)" in cli_error(capsys, "generate",
                                                                 "--prompt-file", file)


def test_bad_prompt_file_jsonl(capsys, tmp_path):
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"prompt": "w1"}\n{"text": "w2"}\n')
    err = cli_error(capsys, "generate", "--prompt-file", file)
    assert 'prompts.jsonl:2: expected a JSON object with a "prompt" string' in err


@pytest.mark.parametrize("flags,message", [
    (["--prompt", "  "], "prompt 0 is empty"),
    (["--max-new-tokens", 0], "max_new_tokens must be >= 1, got 0"),
    (["--width", 0], "tree width must be >= 1, got 0"),
    (["--temperature", -1], "temperature must be >= 0, got -1.0"),
    (["--top-p", 0], "top_p must be in (0, 1], got 0.0"),
    (["--top-k", -2], "top_k must be >= 0, got -2"),
], ids=["empty-prompt", "max-new-tokens", "width", "temperature", "top-p", "top-k"])
def test_bad_decoding_flags(tiny, capsys, flags, message):
    assert message in cli_error(capsys, "generate", "--model", tiny.target, "--no-draft",
                                *flags)


def test_bad_bench_without_head(tiny, capsys):
    err = cli_error(capsys, "bench", "--model", tiny.target)
    assert "bench needs a draft head: pass --draft PATH" in err


def test_bad_no_tokenizer_or_chat_template(tiny):
    target = api.load_target(tiny.target)
    with pytest.raises(TokenizerError, match="has no tokenizer .*pass prompts as token ids"):
        api.generate(dataclasses.replace(target, tokenizer=None), "w1")
    plain = Tokenizer(target.tokenizer.backend, eos_token_ids=(0,))
    with pytest.raises(TokenizerError, match=r"has no chat template; pass chat=False \(--no-chat"):
        api.generate(dataclasses.replace(target, tokenizer=plain), "w1")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks a machine without a GPU")
@pytest.mark.parametrize("impl", GPU_ONLY)
def test_bad_gpu_only_attn_impl_on_cpu(capsys, impl):
    err = cli_error(capsys, "generate", "--attn-impl", impl)
    assert (f"attention kernel {impl!r} needs a GPU; this machine has only CPU devices; "
            "use reference") in err


@pytest.mark.parametrize("old", ["xla", "triton", "mosaic", "fused"])
def test_old_attn_impl_names_get_a_one_line_error_listing_the_choices(capsys, old):
    err = cli_error(capsys, "generate", "--attn-impl", old)
    assert err.strip().count("\n") == 0
    assert (f"unknown attention kernel {old!r}; choose from auto, reference, portable, hopper, "
            "decode, fused_decode") in err


def test_cli_train_data_then_train_draft_then_generate(tiny, capsys, tmp_path):
    """The training verbs end to end: data from the target, a head trained on it (and resumed
    by a rerun), then speculative decoding with that head."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "w{i} w{i + 1} w{i + 2}"}}\n' for i in range(3, 15)))
    data = tmp_path / "data"
    code, out, _ = run_cli(capsys, "train-data", "--model", tiny.target, "--prompts", prompts,
                           "--split", "train", "--out", data, "--max-seqs", 12,
                           "--max-prompt-len", 16, "--max-new-tokens", 10, "--shard-size", 8,
                           "--batch-size", 4)
    assert code == 0 and "sequences" in out and (data / "manifest.json").exists()
    run = tmp_path / "run"
    # The head shape of the `tiny` fixture: decoding with it below reuses the programs compiled
    # for that head.
    train = ("train-draft", "--model", tiny.target, "--data", data, "--out", run, "--steps", 6,
             "--head-layers", 2, "--block-size", 6, "--num-taps", 2, "--batch-size", 2,
             "--num-anchors", 2, "--ckpt-every", 3, "--eval-every", 100)
    code, out, _ = run_cli(capsys, *train)
    assert code == 0 and "trained 6 steps" in out and (run / "head").is_dir()
    code, out, _ = run_cli(capsys, *train)  # already finished: resumes at step 6, no work
    assert code == 0 and "trained 6 steps" in out
    code, out, _ = run_cli(capsys, "generate", "--model", tiny.target, "--draft", run / "head",
                           *PROMPT_FLAGS, "--max-new-tokens", 10,
                           "--budget", 8, "--compare")
    assert code == 0 and "identical: yes" in out
