"""Fixtures shared by every test module."""

import atexit
import importlib.util
import os
import shutil
import tempfile

# Compiling is most of these tests' time (tiny models, thousands of programs): on the CPU, XLA's
# cheaper LLVM passes cut it by about a third. Set before JAX starts its backend, for the test
# processes and the commands they start alike, so every compared pair of runs shares them. Not
# where a GPU plugin is installed: a GPU run of the tests compiles the kernels users get.
if importlib.util.find_spec("jax_plugins") is None or os.environ.get("JAX_PLATFORMS") == "cpu":
    os.environ["XLA_FLAGS"] = " ".join(filter(None, (
        os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true")))

import jax  # noqa: E402
import pytest

# Tests neither read nor fill the user's cache of converted targets and compiled programs
# (tests/test_cache.py turns it on in a temporary directory).
os.environ["JETSPEC_NO_CACHE"] = os.environ["JETSPEC_NO_COMPILE_CACHE"] = "1"

# Instead a test run keeps its compiled programs in a fresh temporary directory, shared by its
# worker processes and the commands they start (CLI runs, notebooks, bench scripts): the same
# tiny program built again (every train() call builds its step anew, every CLI run its loop,
# the other worker its copy of a shape) is read back rather than compiled. The process that
# starts the run makes it (pytest-xdist's workers inherit the variable) and removes it at exit.
# It starts empty, so a run's work does not depend on an earlier run.
_RUN_DIR = "JETSPEC_TEST_RUN_DIR"
if not os.environ.get(_RUN_DIR):
    os.environ[_RUN_DIR] = tempfile.mkdtemp(prefix="jetspec-tests-")
    atexit.register(shutil.rmtree, os.environ[_RUN_DIR], ignore_errors=True)
_XLA_CACHE = os.path.join(os.environ[_RUN_DIR], "xla")
# (An entry read while another process still writes it fails to decompress: JAX warns and
# compiles the program itself.)
for _name, _value in (("jax_compilation_cache_dir", _XLA_CACHE),
                      ("jax_persistent_cache_min_compile_time_secs", 0.0),
                      ("jax_persistent_cache_min_entry_size_bytes", 0)):
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """Float32 references must be exact: on a GPU, XLA's default matmul precision is TF32, while
    our kernels' float32 dots run at `highest` (the H200 run of 2026-11-30 failed every float32
    kernel test without this)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def use_smollm2_cache(monkeypatch):
    """This test (and the commands it starts) loads SmolLM2 from the run's converted copy
    (`helpers.smollm2_cache`)."""
    from helpers import smollm2_cache

    monkeypatch.setenv("JETSPEC_CACHE", smollm2_cache())
    monkeypatch.delenv("JETSPEC_NO_CACHE")
