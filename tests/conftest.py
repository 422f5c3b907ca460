"""Fixtures shared by every test module."""

import os

import jax
import pytest

# Tests neither read nor fill the user's cache of converted targets and compiled programs
# (tests/test_cache.py turns it on in a temporary directory).
os.environ["JETSPEC_NO_CACHE"] = os.environ["JETSPEC_NO_COMPILE_CACHE"] = "1"


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """Float32 references must be exact: on a GPU, XLA's default matmul precision is TF32, while
    our kernels' float32 dots run at `highest` (the H200 run of 2026-11-30 failed every float32
    kernel test without this)."""
    with jax.default_matmul_precision("highest"):
        yield
