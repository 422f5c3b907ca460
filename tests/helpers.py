"""Shared builders for tests: tiny random targets and heads, and a runner for the training
scripts with a stand-in python."""

import fcntl
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.draft import head as draft_head
from jetspec_jax.model import config, params as P

TINY = {"dense": config.tiny_dense, "moe": config.tiny_moe, "llama": config.tiny_llama}
SMOLLM2 = "smollm2-135m"


def smollm2_cache() -> str:
    """A cache directory (JETSPEC_CACHE) holding the embedded SmolLM2 converted once per test
    run, shared by its workers (the first converts it under a file lock): tests that decode,
    serve or run a notebook on SmolLM2 read that copy instead of converting the GGUF each.
    tests/test_convert.py tests the conversion itself, tests/test_cache.py the cache."""
    from jetspec_jax import api
    from jetspec_jax.io import cache

    root = os.path.join(os.environ["JETSPEC_TEST_RUN_DIR"], "jetspec-cache")  # conftest.py
    os.makedirs(root, exist_ok=True)
    with pytest.MonkeyPatch.context() as env, open(os.path.join(root, ".lock"), "w") as lock:
        env.setenv("JETSPEC_CACHE", root)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache.target_path(SMOLLM2, "float32") / "metadata.json").exists():
            api.load_target(SMOLLM2, progress=False, use_cache=True)
    return root


def tiny_target(kind="dense", seed=0, vocab=16, scale=1.0, **changes):
    cfg = TINY[kind](vocab_size=vocab, num_layers=3, **changes)
    return cfg, P.init_params(P.target_specs(cfg), jax.random.key(seed), scale=scale)


def tiny_head(tcfg, seed=1, block_size=6, causal=True, mask_token_id=None, num_layers=2):
    dcfg = draft_head.draft_config_for(tcfg, num_layers=num_layers, block_size=block_size,
                                       num_taps=2, mask_token_id=mask_token_id, causal=causal)
    return dcfg, P.init_params(draft_head.draft_specs(dcfg), jax.random.key(seed))


def loop_args(sampler=None, **loop) -> dict:
    """The sampler and the `Loop` a decoding entry point takes (greedy by default)."""
    from jetspec_jax.decode.loop import Loop
    from jetspec_jax.decode.sampling import Sampler
    return dict(sampler=sampler or Sampler(), loop=Loop(**loop))


def random_prompts(rng: np.random.Generator, batch, max_len, vocab):
    lens = rng.integers(1, max_len + 1, size=batch)
    prompt = np.zeros((batch, max_len), np.int32)
    for b, n in enumerate(lens):
        prompt[b, :n] = rng.integers(0, vocab, size=n)
    return jnp.asarray(prompt), jnp.asarray(lens, jnp.int32)


def tree_equal(a, b):
    """Same structure, dtypes, shapes and values."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def count_eqns(fn, *args, primitive: str = "pallas_call", name: str | None = None) -> int:
    """How many `primitive` equations `fn(*args)` runs (pallas_call: those whose kernel name
    contains `name`, if given), counted per call site through nested jaxprs (jit, loops,
    conds). Mosaic GPU kernels in interpret mode trace to their body: count e.g. "wgmma_ref"."""
    closed = jax.make_jaxpr(fn)(*args)

    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name == primitive and (
                name is None or name in str(eqn.params.get("name")))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        n += count(inner)
        return n

    return count(closed.jaxpr)


# Stands in for python3 in the training scripts' tests: records the CLI's arguments, and
# train-draft writes a finished head's metadata.
FAKE_TRAINING_PY = """#!/usr/bin/env bash
echo "$@" >> "$CALLS"
if [[ $3 == train-draft ]]; then
  out=$(echo "$@" | sed -n 's/.*--out \\([^ ]*\\).*/\\1/p')
  mkdir -p "$out/head" && echo '{"complete": true}' > "$out/head/metadata.json"
fi
"""


def run_training_script(tmp_path, script, env: dict, make_data: bool = True):
    """bash scripts/SCRIPT with RUN = tmp_path/run (holding data/ and heldout/ when make_data)
    and the fake python -> (the finished process, the CLI calls it made, one line each)."""
    run = tmp_path / "run"
    if make_data:
        (run / "data").mkdir(parents=True, exist_ok=True)
        (run / "heldout").mkdir(exist_ok=True)
    py = tmp_path / "py"
    py.write_text(FAKE_TRAINING_PY)
    py.chmod(0o755)
    calls = tmp_path / "calls"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "scripts" / script)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "RUN": str(run), "PY": str(py),
                               "CALLS": str(calls), **env})
    return done, (calls.read_text().splitlines() if calls.exists() else [])


def tiny_models():
    """A tiny random target (vocabulary 64) and head, as the serving tests load them."""
    from jetspec_jax.io.load import Draft, Target

    tcfg, tparams = tiny_target("dense", seed=5, vocab=64)
    dcfg, dparams = tiny_head(tcfg, seed=6, block_size=4)
    return Target(tcfg, tparams, None, "tiny"), Draft(dcfg, dparams)
