"""Fixtures shared by every test module."""

import jax
import pytest


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """Float32 references must be exact: on a GPU, XLA's default matmul precision is TF32, while
    our kernels' float32 dots run at `highest` (the H200 run of 2026-11-30 failed every float32
    kernel test without this)."""
    with jax.default_matmul_precision("highest"):
        yield
