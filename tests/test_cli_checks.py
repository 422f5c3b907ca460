"""The CLI's checks before anything loads: every path, file and number of docs/bad_inputs.md's
new rows fails in one line with exit code 2, and without importing JAX (so within a second or
two of starting); the flag tables need no JAX either."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jetspec_jax.cli import TRAIN_DEFAULTS, TRAIN_HEADS, main
from jetspec_jax.model.config import ConfigError, load_hf_config

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
HEAD = ROOT / "checkpoints" / "smollm2-135m-jetspec"


def one_line_error(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def target_without_params(path: Path) -> Path:
    """A folder whose metadata says it is one of our target checkpoints, with no arrays."""
    path.mkdir()
    (path / "metadata.json").write_text('{"kind": "target", "format": 1}')
    (path / "config.json").write_text("{}")
    return path


def hf_copy(tmp_path, text=None, **changes):
    """The tiny llama HF fixture with its config.json replaced by text or edited."""
    src = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama", src)
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not ...}
    (src / "config.json").write_text(json.dumps(config) if text is None else text)
    return src


@pytest.mark.parametrize("text,changes,message", [
    ('{"architectures": [', {}, "config.json: not valid JSON: Expecting value"),
    ("[1, 2]", {}, "config.json: expected a JSON object of config keys, got list"),
    (None, {"num_attention_heads": ...}, "config.json: missing key 'num_attention_heads'"),
    (None, {"hidden_size": "64", "rms_norm_eps": -1},
     "config.json: key 'hidden_size' must be a positive integer, got '64'; key 'rms_norm_eps' "
     "must be a positive number, got -1"),
    (None, {"architectures": ["GPT2LMHeadModel"]},
     "config.json: unsupported architecture ['GPT2LMHeadModel'] (key 'architectures')"),
], ids=["not-json", "not-object", "missing-key", "mistyped-keys", "architecture"])
def test_bad_config_json(capsys, tmp_path, text, changes, message):
    src = hf_copy(tmp_path, text, **changes)
    assert str(src / message) in one_line_error(capsys, "convert", src, tmp_path / "out")
    assert str(src / message) in one_line_error(capsys, "generate", "--model", src)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError) as e:  # the API says the same
        load_hf_config(src)
    assert str(src / message) in str(e.value)


def test_bad_model_paths(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, "generate", "--model", tmp_path / "empty")
    assert "empty is an empty directory; expected a jetspec_jax checkpoint" in err
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf")
    assert "fake.gguf is not a GGUF file" in one_line_error(capsys, "generate", "--model",
                                                          tmp_path / "fake.gguf")
    src = hf_copy(tmp_path)
    (src / "model.safetensors").unlink()
    assert "has neither model.safetensors nor model.safetensors.index.json" in one_line_error(
        capsys, "generate", "--model", src)
    ours = target_without_params(tmp_path / "ours")
    assert "ours is not a complete checkpoint: no params/ directory" in one_line_error(
        capsys, "generate", "--model", ours)


def test_bad_draft_folders(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, "generate", "--draft", tmp_path / "empty")
    assert "draft head " in err and "empty is an empty directory; expected a jetspec_jax " \
        "draft-head checkpoint" in err
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README").write_text("hi")
    assert "cannot tell what" in one_line_error(capsys, "generate", "--draft", notes)
    target = target_without_params(tmp_path / "target")
    assert "holds a 'target' checkpoint, not 'draft_head'" in one_line_error(
        capsys, "generate", "--draft", target)
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text('{"block_size": 4}')
    assert f"draft head {ref} has no weights" in one_line_error(capsys, "bench", "--draft", ref)


def test_bad_numbers_reported_together(capsys):
    err = one_line_error(capsys, "generate", "--max-new-tokens", -5, "--width", 0, "--top-p",
                         1.5)
    assert "max_new_tokens must be >= 1, got -5; tree width must be >= 1, got 0; top_p must " \
        "be in (0, 1], got 1.5" in err
    assert "budget must be in [1, 1024], got 2000" in one_line_error(capsys, "bench",
                                                                     "--budgets", 4, 2000)


def test_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--budget", "big"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err == ("error: argument --budget: expected a number of tree nodes or 'auto', got "
                   "'big' (see jetspec generate --help)\n")


def test_bad_output_paths(capsys, tmp_path):
    err = one_line_error(capsys, "bench", "--out", tmp_path / "no" / "bench.json")
    assert f"--out {tmp_path}/no/bench.json: the directory {tmp_path}/no does not exist" in err
    assert "is a directory; give a file name" in one_line_error(capsys, "bench", "--out",
                                                                tmp_path)
    (tmp_path / "file").write_text("")
    assert "is a file, not a directory" in one_line_error(
        capsys, "train-data", "--out", tmp_path / "file")
    assert "the directory" in one_line_error(capsys, "convert", "smollm2-135m",
                                             tmp_path / "a" / "b")
    assert "--data " in one_line_error(capsys, "train-draft", "--data", tmp_path / "none",
                                       "--out", tmp_path / "run")
    assert "--samples must be >= 0, got -1" in one_line_error(
        capsys, "train-data", "--out", tmp_path / "d", "--samples", -1)


def test_unknown_attn_impl(capsys, tmp_path, monkeypatch):
    assert "unknown attention kernel 'x'; choose from auto, reference, portable" in \
        one_line_error(capsys, "generate", "--attn-impl", "x", "--draft", HEAD)
    assert "unknown attention kernel 'x'" in one_line_error(
        capsys, "train-draft", "--data", tmp_path, "--out", tmp_path / "run",
        "--target-attention", "x")
    assert "head_attention 'cudnn' needs a GPU" in one_line_error(  # before the target loads
        capsys, "train-draft", "--data", tmp_path, "--out", tmp_path / "run",
        "--head-attention", "cudnn")
    assert "unknown attention kernel 'x'" in one_line_error(
        capsys, "train-data", "--out", tmp_path / "d", "--attn-impl", "x")
    from jetspec_jax import api

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded before the kernels were checked")

    monkeypatch.setattr(api, "load_target", no_load)
    assert "'decode' needs a GPU" in one_line_error(
        capsys, "train-data", "--out", tmp_path / "d", "--attn-impl", "decode")


def test_checks_run_before_jax_is_imported(tmp_path):
    """Each bad input fails without JAX imported: before any loading, in about a tenth of a
    second (one process for all of them)."""
    (tmp_path / "empty").mkdir()
    cases = [["generate", "--draft", str(tmp_path / "empty")],
             ["generate", "--max-new-tokens", "-5"],
             ["generate", "--prompt-file", str(tmp_path / "none.txt")],
             ["bench", "--out", str(tmp_path / "no" / "b.json")],
             ["generate", "--model", str(hf_copy(tmp_path, "[1]"))],
             ["generate", "--model", str(tmp_path / "absent")],
             ["generate", "--attn-impl", "mosaic"], ["serve", "--attn-impl", "fused"]]
    code = ("import sys; from jetspec_jax.cli import main\n"
            f"codes = [main(a) for a in {cases!r}]\n"
            "print(codes, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.stdout.strip() == f"{[2] * len(cases)} False", out.stderr[-2000:]
    assert out.stderr.count("error: ") == len(cases)


def test_help_needs_no_jax():
    code = ("import sys, contextlib, io\nfrom jetspec_jax.cli import main\n"
            "for c in ([], ['generate'], ['bench'], ['serve'], ['convert'], ['train-data'],"
            " ['train-draft'], ['cache']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):"
            "\n        main([*c, '--help'])\n"
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_train_draft_defaults_are_the_trainers():
    from jetspec_jax.draft.head import DraftConfig
    from jetspec_jax.train.trainer import HEADS, TrainConfig

    d = TrainConfig(data_dir="", out_dir="")
    assert TRAIN_DEFAULTS == {k: getattr(d, k) for k in TRAIN_DEFAULTS}
    # the core's heads (others register beside them: `python -m lab`)
    assert TRAIN_HEADS == tuple(sorted(h for h, k in HEADS.items()
                                       if k.config_type is DraftConfig))

