"""The cache of converted targets and compiled programs (`jetspec_jax.io.cache`), in a
temporary directory: a source is converted once per content and dtype, later loads read our
checkpoint, files are hashed once, `jetspec cache ls / clear`, and JAX keeps compiled
programs there."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jetspec_jax import api
from jetspec_jax.cli import main
from jetspec_jax.io import cache, convert

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def in_tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JETSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JETSPEC_NO_CACHE")
    return tmp_path / "cache"


def test_converted_once_then_read(in_tmp_cache, tmp_path, monkeypatch, capsys):
    src = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", src)
    first = api.load_target(src, progress=False)
    entry = cache.target_path(src, "float32")
    assert entry.parent == in_tmp_cache / "targets" and (entry / "metadata.json").exists()
    assert entry.name.startswith("llama-float32-")

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    with monkeypatch.context() as m:
        m.setattr(convert, "read_target", no_conversion)
        second = api.load_target(src)
    assert second.cfg == first.cfg and second.source == str(src)
    for x, y in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    api.load_target(src, dtype="bfloat16", progress=False)  # another dtype: another entry
    (src / "config.json").write_text((src / "config.json").read_text().replace("1e-06", "1e-05"))
    changed = api.load_target(src, progress=False)  # new contents: converted again
    assert changed.cfg.rms_norm_eps == 1e-5 and cache.target_path(src, "float32") != entry
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert out.count("llama-float32-") == 2 and out.count("llama-bfloat16-") == 1
    assert f"(from {src})" in out
    assert main(["cache", "clear"]) == 0 and "MB freed" in capsys.readouterr().out
    assert not (in_tmp_cache / "targets").exists()
    main(["cache", "ls"])
    assert capsys.readouterr().out.strip() == f"{in_tmp_cache}: empty"


def test_off_switch(in_tmp_cache, monkeypatch):
    monkeypatch.setenv("JETSPEC_NO_CACHE", "1")
    api.load_target(FIXTURES / "llama", progress=False)
    assert not (in_tmp_cache / "targets").exists()
    api.load_target(FIXTURES / "llama", progress=False, use_cache=True)
    assert len(list((in_tmp_cache / "targets").iterdir())) == 1


def test_file_hashed_once(in_tmp_cache, tmp_path):
    file = tmp_path / "weights.gguf"
    file.write_bytes(b"GGUF" + bytes(1000))
    real = cache.file_hash(file)
    memo = cache.cache_dir() / cache.HASHES
    memo.write_text(memo.read_text().replace(real, "remembered"))
    assert cache.file_hash(file) == "remembered"  # same path, size and mtime: not read again
    file.write_bytes(b"GGUF" + bytes(1001))
    assert cache.file_hash(file) not in ("remembered", real)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("JETSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "jetspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == Path.home() / ".cache" / "jetspec"


@pytest.mark.parametrize("off", [False, True])
def test_compiled_programs_kept(tmp_path, off):
    env = {**os.environ, "JETSPEC_CACHE": str(tmp_path)}
    env.pop("JETSPEC_NO_COMPILE_CACHE")
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)  # the test processes' own cache (conftest.py): a user's setup here
    if off:
        env["JETSPEC_NO_COMPILE_CACHE"] = "1"
    code = ("from jetspec_jax.io import cache; cache.enable_compile_cache()\n"
            "import jax, jax.numpy as jnp\n"
            "jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    kept = list((tmp_path / "xla").glob("jit__lambda*")) if (tmp_path / "xla").exists() else []
    assert len(kept) == (0 if off else 1)
