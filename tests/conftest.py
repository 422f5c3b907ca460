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

# Instead each test process keeps its compiled programs in a fresh temporary directory, and
# the commands it starts (CLI runs, notebooks, bench scripts) share it: the same tiny program
# built again (every train() call builds its step anew, every CLI run its loop) is read back
# rather than compiled. It starts empty, so a run's work does not depend on an earlier run.
_XLA_CACHE = tempfile.mkdtemp(prefix="jetspec-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
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
