"""Tensor and expert parallel decoding (`jetspec_jax/model/sharding.py`) on fake CPU devices.

Fake devices need XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported,
and the pytest workers have imported jax (one device) long before this module. A conftest
setting the flag would give every other test 8 devices too, so the multi-device checks run
this file as a script in a child process instead (`python tests/test_sharding.py CHECK`): one
child per check, a few seconds of start-up each. Mesh-spec errors need no devices and run
in-process.
"""

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from helpers import loop_args, random_prompts, tiny_head, tiny_target
from jetspec_jax import api
from jetspec_jax.cli import main
from jetspec_jax.decode.speculative import TreeSpec, spec_generate
from jetspec_jax.draft import head as draft_head
from jetspec_jax.io.checkpoints import load_target_checkpoint, save_target
from jetspec_jax.model import config, params as P, sharding
from jetspec_jax.model.cache import KV_AXES

FAKE_DEVICES = 8
COLLECTIVES = r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\b"
KW = loop_args(max_new=16, num_slots=128)
# (spec, devices): dense on every mesh size: one device (no collectives), tp=2 shards the 4
# heads and the 2 KV heads, tp=4 replicates the KV heads, tp=8 both (only the MLP and the vocab
# are sharded); MoE with its experts replicated (tp only) and split over ep=4 (ep=2 splits them
# the same way; one device, no collectives, is checked on dense).
MESHES = {"dense": [("1", 1), ("tp=2", 2), ("tp=4", 4), ("tp=8", 8)],
          "moe": [("tp=2", 2), ("tp=2,ep=4", 8)]}


# ---- pytest side ---------------------------------------------------------------------------------


def run_child(check: str, *args: str):
    # Cheaper LLVM passes halve XLA:CPU compile time; both runs compared share them.
    flags = (f"--xla_force_host_platform_device_count={FAKE_DEVICES} "
             "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    r = subprocess.run([sys.executable, __file__, check, *args], env=env, capture_output=True,
                       text=True, timeout=600, cwd=Path(__file__).parent)
    assert r.returncode == 0, f"check {check} failed:\n{r.stdout}\n{r.stderr[-6000:]}"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sharded_speculative_equals_unsharded(kind):
    run_child("equal", kind)


def test_greedy_argmax_on_a_mesh_needs_no_all_gather():
    run_child("argmax")


def test_checkpoint_loads_into_shards_and_api_cli_decode_on_a_mesh(tmp_path):
    run_child("checkpoint", str(tmp_path))


def test_served_greedy_output_on_a_mesh_equals_unsharded():
    run_child("serve")


@pytest.mark.parametrize("spec,problem", [
    ("tp=2", "needs 2 devices but 1 are given"),
    ("tp=2,xp=2", "unknown axis 'xp'"),
    ("tp", "'tp' is not NAME=SIZE"),
    ("tp=0", "axis 'tp' has size 0"),
    ("tp=1,tp=1", "axis 'tp' given twice"),
    ("", "'' is not NAME=SIZE"),
])
def test_bad_mesh_specs_are_named(spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        sharding.make_mesh(spec, jax.devices()[:1])


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_reports_a_bad_mesh_before_loading(command, capsys):
    code = main([command, "--mesh", "tp=2,xp=4"])  # the embedded model: not loaded
    assert code == 2
    assert "unknown axis 'xp'" in capsys.readouterr().err


def test_rules_replicate_what_does_not_divide():
    tcfg = config.tiny_moe()  # 4 heads, 2 KV heads, 8 experts, MLP 32
    shape = {"tp": 4, "ep": 2}
    assert sharding.logical_spec(("embed", "heads", "head_dim"), (64, 4, 16), shape) == PS(
        None, "tp", None)
    assert sharding.logical_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), shape) == PS(
        None, None, None)
    assert sharding.logical_spec(("experts", "embed", "mlp"), (8, 64, 32), shape) == PS(
        "ep", None, "tp")
    assert sharding.replicated_dims(P.target_specs(tcfg), shape) == [
        "kv_heads=2 not divisible by tp=4: replicated"]


# ---- child side: run with FAKE_DEVICES CPU devices ---------------------------------------------


def on_mesh(mesh, tparams, tcfg, dparams, dcfg, prompt, lens):
    """Weights sharded by the rules, small inputs replicated."""
    return (sharding.shard_params(tparams, P.target_specs(tcfg), mesh),
            sharding.shard_params(dparams, draft_head.draft_specs(dcfg), mesh),
            *sharding.replicate((prompt, lens, jax.random.key(0)), mesh))


def check_equal(kind):
    """Greedy speculative decoding on the meshes of MESHES gives the unsharded run's tokens;
    the compiled program has the collectives tensor parallelism needs (none on one device),
    and keeps each device's KV cache at its shard's shape."""
    tcfg, tp = tiny_target(kind, seed=1, vocab=16)
    dcfg, dp = tiny_head(tcfg, block_size=6)
    prompt, lens = random_prompts(np.random.default_rng(0), 3, 7, tcfg.vocab_size)
    kw = dict(tcfg=tcfg, dcfg=dcfg, tree_spec=TreeSpec(16, 4), **KW)
    ref, _ = spec_generate(tp, dp, prompt, lens, jax.random.key(0), **kw)
    for spec, n in MESHES[kind]:
        mesh = sharding.make_mesh(spec, jax.devices()[:n])
        args = on_mesh(mesh, tp, tcfg, dp, dcfg, prompt, lens)
        with sharding.use(mesh):
            compiled = spec_generate.lower(*args, **kw).compile()
        out, _ = compiled(*args)
        np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(ref.num_tokens))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), spec)
        hlo = compiled.as_text()
        ops = set(re.findall(COLLECTIVES, hlo))
        if n == 1:
            assert not ops, (spec, ops)
            continue
        # Row-parallel o / down projections (and MoE experts split over ep) end in partial
        # sums; the vocab-parallel argmax / top-k gathers per-shard winners; nothing else.
        assert "all-reduce" in ops and ops <= {"all-reduce", "all-gather"}, (spec, ops)
        full = (3, tcfg.num_kv_heads, KW["loop"].num_slots, tcfg.head_dim)
        part = jax.sharding.NamedSharding(
            mesh, sharding.logical_spec(KV_AXES, full, mesh.shape)).shard_shape(full)
        assert hlo_shape(part) in hlo, (spec, part)
        if part != full:  # the cache is never gathered whole
            assert hlo_shape(full) not in hlo, spec
        print(spec, "ok:", sorted(ops), "cache shard", part)


def check_argmax():
    """Greedy tokens on a tensor-parallel mesh: the vocab-parallel argmax is two all-reduces,
    no all-gather (those were slow on 2 H200s), and gives jnp.argmax's answer, ties included
    (the first index of the max); greedy AR decoding gives the unsharded tokens."""
    from jetspec_jax.decode.autoregressive import ar_generate
    from jetspec_jax.decode.sampling import greedy_tokens

    mesh = sharding.make_mesh("tp=8")
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 3, (5, 64)).astype(np.float32)  # many ties in each row
    on_mesh_logits = jax.device_put(logits, jax.sharding.NamedSharding(mesh, PS(None, "tp")))
    with sharding.use(mesh):
        got = jax.jit(greedy_tokens)(on_mesh_logits)
    np.testing.assert_array_equal(np.asarray(got), np.argmax(logits, axis=-1))

    tcfg, tp = tiny_target("dense", seed=3, vocab=32)
    prompt, lens = random_prompts(np.random.default_rng(1), 3, 7, tcfg.vocab_size)
    kw = dict(cfg=tcfg, **KW)
    ref = ar_generate(tp, prompt, lens, jax.random.key(0), **kw)
    mesh = sharding.make_mesh("tp=2", jax.devices()[:2])
    args = (sharding.shard_params(tp, P.target_specs(tcfg), mesh),
            *sharding.replicate((prompt, lens, jax.random.key(0)), mesh))
    with sharding.use(mesh):
        compiled = ar_generate.lower(*args, **kw).compile()
    out = compiled(*args)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    ops = set(re.findall(COLLECTIVES, compiled.as_text()))
    assert ops == {"all-reduce"}, ops
    print("argmax ok:", sorted(ops))


def hlo_shape(shape):
    return "f32[" + ",".join(map(str, shape)) + "]"


def check_checkpoint(tmp):
    """A checkpoint read into shards holds on each device just its part; the API (whole and
    streamed) and the CLI decode on a mesh with the tokens of one device."""
    from test_api_cli import word_tokenizer

    from jetspec_jax.io.heads import save_draft

    tmp = Path(tmp)
    tcfg, tp = tiny_target("moe", seed=2, vocab=32)
    path = save_target(tmp / "target", tp, tcfg, tokenizer=word_tokenizer())
    mesh = sharding.make_mesh("tp=2,ep=4")
    _, params, _ = load_target_checkpoint(path, sharding=sharding.param_shardings(
        P.target_specs(tcfg), mesh))
    expect = {"q": (64, 2, 16),  # [D, N, H]: 4 heads over tp=2
              "k": (64, 1, 16),  # [D, K, H]: 2 KV heads over tp=2
              "gate": (2, 64, 16),  # [E, D, F]: 8 experts over ep=4, F=32 over tp=2
              "router": (64, 8), "attn_norm": (64,)}  # replicated
    for name, shard in expect.items():
        arr = params["layers"][0][name]
        assert [s.data.shape for s in arr.addressable_shards] == [shard] * 8, name
    assert {s.data.shape for s in params["embed"].addressable_shards} == {(16, 64)}  # V/tp
    jax.tree.map(np.testing.assert_array_equal, params, tp)

    dcfg, dp = tiny_head(tcfg, block_size=6)
    head = save_draft(tmp / "head", dp, dcfg)
    run = dict(prompts="w1 w2 w3 w4", max_new_tokens=12, budget=8, compare_autoregressive=True)
    # One device, autoregressive: greedy speculative decoding must give these tokens.
    one = api.generate(api.load_target(path), run["prompts"], max_new_tokens=12)
    target = api.load_target(path, mesh="tp=2,ep=4")  # our checkpoint: read into shards
    assert target.params["layers"][0]["gate"].sharding.spec == PS("ep", None, "tp")
    sharded = api.generate(target, draft=api.load_draft(head, target), **run)
    assert sharded.tokens == one.tokens and sharded.ar_tokens == one.tokens
    run.pop("compare_autoregressive")
    streamed = api.stream(target, draft=api.load_draft(head, target), chunk=3, **run)
    assert sum((c.tokens[0] for c in streamed), []) == one.tokens[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["generate", "--model", str(path), "--draft", str(head), "--mesh",
                     "tp=2,ep=4", "--max-new-tokens", "12", "--budget", "8", "--prompt",
                     "w1 w2 w3 w4", "--compare"])
    assert code == 0 and "greedy outputs identical: yes" in printed.getvalue(), printed.getvalue()
    print("checkpoint ok")


def check_serve():
    """Concurrent greedy requests to a server whose target and head are sharded over tp=2
    (one prompt longer than a prefill pass) get the unsharded tokens; the slots' KV caches
    stay split by KV head."""
    import concurrent.futures as futures

    import httpx

    from jetspec_jax.io.load import Draft, Target, fit_draft
    from jetspec_jax.serve.app import Server
    from jetspec_jax.serve.engine import Engine, EngineConfig

    tcfg, tp = tiny_target("dense", seed=4, vocab=32)
    dcfg, dp = tiny_head(tcfg, block_size=4)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 32, n).tolist() for n in (3, 20, 7)]
    one = api.generate(Target(tcfg, tp, None, "tiny"), prompts, max_new_tokens=10).tokens
    mesh = sharding.make_mesh("tp=2", jax.devices()[:2])
    target = Target(tcfg, sharding.shard_params(tp, P.target_specs(tcfg), mesh), None, "tiny",
                    mesh=mesh)
    engine = Engine(target, fit_draft(Draft(dcfg, dp), target), EngineConfig(
        max_batch=4, slot_buckets=(4,), max_len=48, budget=8, prefill_chunk=8))
    server = Server(engine, "tiny").start()
    try:
        def complete(ids):
            r = httpx.post(server.url + "/v1/completions", timeout=120, json=dict(
                model="tiny", prompt=ids, max_tokens=10, temperature=0, return_token_ids=True))
            return r.json()["choices"][0]["token_ids"]

        with futures.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(complete, prompts)) == one
        k = engine.state.cache.k[0]  # [B, K, S, H]
        assert k.sharding.shard_shape(k.shape)[1] == tcfg.num_kv_heads // 2
    finally:
        server.stop()
    print("serve ok")


if __name__ == "__main__":
    if jax.device_count() < FAKE_DEVICES:
        sys.exit(f"needs {FAKE_DEVICES} devices: set XLA_FLAGS=--xla_force_host_platform_device_"
                 f"count={FAKE_DEVICES} (the pytest tests do)")
    {"equal": check_equal, "checkpoint": check_checkpoint,
     "argmax": check_argmax, "serve": check_serve}[sys.argv[1]](*sys.argv[2:])
