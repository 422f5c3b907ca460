"""Training prompts (five sources, deduplication, a train / held-out split that shares no
prompt text, prompt files) and the self-distillation data's sampled answers, on a tiny target."""

import ast
import itertools
import json
import lzma
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import tiny_target
from jetspec_jax import api
from jetspec_jax.cli import main
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.io.checkpoints import save_target
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.train import data as D, prompts as P
from jetspec_jax.train.code_prompts import code_prompts, module_names, stub_prompts
from jetspec_jax.train.competition_prompts import competition_problems
from test_api_cli import VOCAB, word_tokenizer

SCRIPT = Path(__file__).parents[1] / "scripts" / "export_prompts.py"


def conversation(cid, *turns, first="human"):
    roles = ("human", "gpt") if first == "human" else ("gpt", "human")
    return {"id": cid, "conversations": [{"from": roles[i % 2], "value": t}
                                         for i, t in enumerate(turns)]}


def write_sharegpt(path, convs, cut=True):
    text = json.dumps(convs, indent=1)
    path.write_text(text[:-40] if cut else text)  # cut off inside the last object
    return path


def test_normalised_dedup():
    prompts = ["Hello, World!", "hello world", "  HELLO   world?? ", "Hello there", "hello  world."]
    assert [m[0]["content"] for m in P.read_prompts(prompts)] == ["Hello, World!", "Hello there"]
    assert P.normalise("Don't  STOP!\n(now)") == "don t stop now"


def test_sharegpt_every_turn_with_its_history(tmp_path):
    file = write_sharegpt(tmp_path / "s.json", [
        conversation("a_0", "q1", "a1", "q2", "a2", "q3", "a3"),
        conversation("a_1", "more", "q4", "a4", first="gpt"),  # a continued conversation
        {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "human", "value": "q5"}]},
        conversation("c_0", "lost in the cut", "x")])
    u, a = (lambda t: {"role": "user", "content": t}), (lambda t: {"role": "assistant",
                                                                   "content": t})
    assert list(P.sharegpt_prompts(file)) == [
        [u("q1")], [u("q1"), a("a1"), u("q2")], [u("q1"), a("a1"), u("q2"), a("a2"), u("q3")],
        [a("more"), u("q4")], [{"role": "system", "content": "be brief"}, u("q5")]]
    assert list(P.iter_json_array(file, chunk_chars=7))[-1]["id"] == "b"


def test_split_shares_no_prompt_text(tmp_path):
    """ShareGPT re-shares conversations under other ids (here with other case and spacing);
    splitting by id put copies on both sides. The split by normalised first turn does not."""
    convs = []
    for i in range(150):
        turns = (f"Question {i}: how do I sort a list?", f"Use sorted() ({i}).", f"And in reverse {i}?")
        convs.append(conversation(f"x{i}_0", *turns))
        convs.append(conversation(f"y{i}_0", turns[0].upper() + "  ", *turns[1:]))
    file = write_sharegpt(tmp_path / "s.json", convs, cut=False)
    # The split by id would leak: some pair's two ids fall on different sides.
    by_id = [P.stable_hash(f"{p}{i}") / 2**64 < 0.5 for i in range(150) for p in "xy"]
    assert any(a != b for a, b in zip(by_id[::2], by_id[1::2]))

    train, held = (list(P.read_prompts(file, split=s, heldout_fraction=0.5)) for s in P.SPLITS)
    assert len(train) + len(held) == 300 and len(held) > 30 and len(train) > 30
    texts = [{P.normalise(m["content"]) for ms in side for m in ms} for side in (train, held)]
    assert not texts[0] & texts[1]  # not a whole prompt, nor any turn of one


def test_sources_are_deterministic_and_distinct():
    kw = dict(limits={"math": 3000, "code": 400})
    a, b = P.collect(("math", "code"), seed=0, **kw), P.collect(("math", "code"), seed=0, **kw)
    assert a == b and len(a) == 3400
    other = P.collect(("math",), seed=1, limits={"math": 3000})
    assert {P.prompt_text(r["messages"]) for r in a} & {
        P.prompt_text(r["messages"]) for r in other} != {P.prompt_text(r["messages"]) for r in other}
    assert len({P.prompt_text(r["messages"]) for r in a}) == 3400  # distinct after normalising
    code = [r["messages"][0]["content"] for r in a if r["source"] == "code"]
    assert any(c.startswith("Write a Python function `") for c in code)
    assert any("```python\ndef " in c for c in code)
    # An endless source whose prompts never fit ends instead of looping.
    assert P.collect(("math",), tokenizer=word_tokenizer(), max_prompt_len=4,
                     limits={"math": 50}) == []


def test_competition_problems_and_stubs():
    """Competition problems are LaTeX with balanced $ delimiters; a stub is a function's
    signature and docstring that parses as Python and names a real standard-library function."""
    problems = list(itertools.islice(competition_problems(seed=0), 2500))
    assert problems == list(itertools.islice(competition_problems(seed=0), 2500))
    assert len(set(problems)) > 2000 and all(p.count("$") % 2 == 0 for p in problems)
    assert sum("\\frac" in p or "^" in p for p in problems) > 500
    stubs = list(stub_prompts(seed=0))
    assert len(stubs) > 1000 and stubs == list(stub_prompts(seed=0))
    names = set()
    for prompt in stubs:
        code = re.search(r"```python\n(.*)```", prompt, re.S).group(1)
        (fn,) = ast.parse(code).body
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn)
        names.add(fn.name)
    assert {"dedent", "urljoin", "fnmatch", "mean"} <= names


def test_code_prompts_walk_packages_and_carry_no_addresses():
    """Submodules of the walked packages are sources too, and no prompt shows a default value's
    repr with a memory address (`<object object at 0x...>`), which would differ per process."""
    modules = module_names()
    assert {"logging.handlers", "email.headerregistry", "json.decoder"} <= set(modules)
    assert len(modules) == len(set(modules))
    code = list(code_prompts(seed=0))
    assert len(code) > 20000 and not any(" at 0x" in c for c in code)
    assert any("`logging.handlers." in c for c in code)


def test_heldout_mixes_all_sources(tmp_path, monkeypatch):
    convs = [conversation(f"c{i}", f"Tell me about topic {i}.", "ok", f"More on {i}?")
             for i in range(300)]
    monkeypatch.setattr(P, "sharegpt_path", lambda: write_sharegpt(tmp_path / "s.json", convs))
    limits = {"math": 600, "code": 600, "competition": 600, "stubs": 600}
    records = P.collect(seed=3, limits=limits, heldout_fraction=0.1)
    held = [r for r in P.mixed(records) if r["split"] == "heldout"]
    assert len(held) >= 64 and {r["source"] for r in held[:64]} == set(P.SOURCES)


def test_prompt_files(tmp_path):
    records = P.collect(("math", "code"), seed=0, limits={"math": 300, "code": 300},
                        heldout_fraction=0.2)
    file = tmp_path / "p.jsonl.xz"
    assert P.write_prompt_file(records, file) == 600
    assert lzma.decompress(file.read_bytes()).count(b"\n") == 600
    assert list(P.read_prompt_file(file)) == records
    held_math = [r["messages"] for r in P.mixed(records) if r["split"] == "heldout" and
                 r["source"] == "math"]
    assert list(P.read_prompts(file, split="heldout", sources=["math"])) == held_math
    plain = tmp_path / "p.jsonl"  # the old format: one prompt per line, split by its text
    plain.write_text('{"prompt": "hi"}\n\n{"id": "x", "prompt": "yo"}\n')
    assert [m[0]["content"] for m in P.read_prompts(plain)] == ["hi", "yo"]
    plain.write_text('{"prompt": "hi"}\n{"text": "yo"}\n')
    with pytest.raises(P.PromptError, match=r"p\.jsonl:2: expected a JSON object"):
        list(P.read_prompts(plain))
    with pytest.raises(FileNotFoundError, match="no prompt file"):
        list(P.read_prompts(tmp_path / "nope.jsonl"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target saved with a word-level tokenizer, and loaded back."""
    tcfg, tparams = tiny_target("dense", vocab=VOCAB)
    path = save_target(tmp_path_factory.mktemp("t") / "target", tparams, tcfg,
                       tokenizer=word_tokenizer())
    return path, api.load_target(path)


# The CLI test's generation settings too, so that both share the compiled programs.
GEN = dict(shard_size=4, max_prompt_len=48, max_new=6, batch_size=4, progress=False)


def answers(out_dir):
    """{(prompt tokens, answer number): response tokens} of a dataset."""
    got = {}
    for file in sorted(Path(out_dir).glob("shard-*.npz")):
        with np.load(file) as z:
            for t, n, p, a in zip(z["tokens"], z["lengths"], z["prompt_lengths"], z["answer"]):
                got[tuple(t[:p]), int(a)] = tuple(t[p:n])
    return got


def test_sampled_answers_differ_from_greedy_and_reproduce(tiny, tmp_path):
    _, t = tiny
    make = lambda prompts, out, **kw: D.make_dataset(t.params, t.cfg, t.tokenizer, prompts,
                                                     tmp_path / out, **{**GEN, **kw})
    prompts = [f"w{i} w{i + 2} " + "w5 " * (i % 3) for i in range(3, 9)]
    kw = dict(samples=2, sample_sampler=Sampler(temperature=1.0))
    m = make(prompts, "a", **kw)
    assert m["num_seqs"] == 18 and m["generation"]["tokens_per_s"] > 0
    got, greedy = answers(tmp_path / "a"), (make(prompts, "g") and answers(tmp_path / "g"))
    assert {k: v for k, v in got.items() if k[1] == 0} == greedy  # answer 0 is the greedy one
    firsts = [k[0] for k in greedy]
    assert sum(got[p, 1] != got[p, 0] for p in firsts) >= 5
    assert sum(got[p, 2] != got[p, 0] for p in firsts) >= 5
    assert sum(got[p, 1] != got[p, 2] for p in firsts) >= 5
    # Seeded per prompt: other shards, batch positions and order give the same answers.
    make(prompts[::-1], "b", **kw, shard_size=5)
    assert answers(tmp_path / "b") == got
    with pytest.raises(ValueError, match="temperature > 0"):
        make(prompts, "c", samples=1, sample_sampler=Sampler())


def test_the_gpu_kernels_answer_as_the_reference(tiny, tmp_path):
    """Data made with the one-token decode kernels (interpret mode) holds the reference's
    answers in float32, and its manifest names the kernel."""
    _, t = tiny
    prompts = [f"w{i} w{i + 3} " + "w7 " * (i % 4) for i in range(3, 9)]
    kernels = Kernels(("fused_decode", "decode", "portable"), interpret=True)  # no XLA
    made = D.make_dataset(t.params, t.cfg, t.tokenizer, prompts, tmp_path / "k", **GEN,
                          kernels=kernels)
    D.make_dataset(t.params, t.cfg, t.tokenizer, prompts, tmp_path / "r", **GEN)
    assert made["generation"]["attention"] == "fused_decode"
    assert answers(tmp_path / "k") == answers(tmp_path / "r")


def test_export_then_train_data(tiny, tmp_path, monkeypatch, capsys):
    """scripts/export_prompts.py's file -> `jetspec train-data --prompts`, with samples."""
    model, _ = tiny
    file = tmp_path / "prompts.jsonl.xz"
    monkeypatch.setattr(sys, "argv", ["export", "--out", str(file), "--model", str(model),
                                      "--sources", "math", "code", "--math", "40", "--code",
                                      "20", "--max-prompt-len", "48"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert "wrote 60 prompts" in capsys.readouterr().out
    train = list(P.read_prompts(file, split="train"))[:5]
    out = tmp_path / "data"
    code = main(["train-data", "--model", str(model), "--prompts", str(file), "--out", str(out),
                 "--max-seqs", "5", "--max-prompt-len", "48", "--max-new-tokens", "6",
                 "--shard-size", "4", "--batch-size", "4", "--samples", "1"])
    printed = capsys.readouterr().out
    assert code == 0 and "wrote 10 sequences" in printed and "tokens/s" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_seqs"] == 10 and manifest["generation"]["tokens_per_s"] > 0
    expected = {tuple(word_tokenizer().apply_chat_template(m)) for m in train}
    assert {k[0] for k in answers(out)} == expected


def test_export_refuses_a_count_that_never_ends(tmp_path, monkeypatch, capsys):
    """--competition -1 would let an endless source run forever: refused by name, nothing written."""
    file = tmp_path / "prompts.jsonl.xz"
    monkeypatch.setattr(sys, "argv", ["export", "--out", str(file), "--competition", "-1"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert done.value.code == 2 and not file.exists()
    assert "--competition: expected a whole number >= 1, got '-1'" in capsys.readouterr().err
