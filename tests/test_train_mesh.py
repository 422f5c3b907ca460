"""Data-parallel training (`TrainConfig.mesh = "data=N"`) on 4 fake CPU devices equals training
on one device. As in test_sharding.py, fake devices need XLA_FLAGS before jax is imported, so
the check runs this file as a script in a child process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

FAKE_DEVICES = 4


def test_data_parallel_training_equals_one_device(tmp_path):
    flags = (f"--xla_force_host_platform_device_count={FAKE_DEVICES} "
             "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    root = str(Path(__file__).resolve().parents[1])  # this checkout's package, not another
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags,
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600, cwd=Path(__file__).parent)
    assert r.returncode == 0, f"child failed:\n{r.stdout}\n{r.stderr[-6000:]}"


@pytest.mark.parametrize("spec,problem", [
    ("data=0", "expected data=N"), ("tp=2", "expected data=N"), ("data=8", "needs 8 devices")])
def test_bad_training_meshes_are_named(spec, problem):
    from jetspec_jax.train.parallel import data_mesh

    with pytest.raises(ValueError, match=problem):
        data_mesh(spec)


def child(root: Path) -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from helpers import tiny_target
    from test_train import DATA_KW, PROMPTS, CharTokenizer, train_config
    from jetspec_jax.train import data as D
    from jetspec_jax.train.parallel import data_mesh, place
    from jetspec_jax.train.trainer import make_optimizer, make_steps, read_metrics, train

    assert len(jax.devices()) == FAKE_DEVICES
    tcfg, tp = tiny_target("dense", seed=2, vocab=16)
    D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS[:8], root / "train", **DATA_KW)
    D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS[8:], root / "heldout", **DATA_KW)
    cfg = train_config(root, root / "one", steps=3, eval_every=3, eval_dir=str(root / "heldout"),
                       tau_prompts=0)
    one = train(cfg, tp, tcfg, progress=False)
    four = train(dataclasses.replace(cfg, out_dir=str(root / "four"), mesh=f"data={FAKE_DEVICES}",
                                     tau_prompts=2), tp, tcfg, progress=False)
    # The mesh sums the gradient in another order, and AdamW divides each gradient element by
    # its own RMS: an element whose gradient is near zero carries that rounding into a visible
    # share of its update (seen: one of 8,192 weights 3e-5 apart after 3 steps). A wrong split
    # of the batch moves every weight by a share of lr = 3e-3 instead.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=5e-5, atol=1e-6),
                 jax.device_get(four.dparams), jax.device_get(one.dparams))
    a, b = (read_metrics(root / d / "metrics.jsonl")[-1] for d in ("one", "four"))
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    np.testing.assert_allclose(b["eval"]["kl"], a["eval"]["kl"], rtol=1e-5)
    assert b["eval"]["tau"] >= 1.0  # decoded on one device beside the mesh
    # The step is partitioned, not run whole on each device: its batch arrives split in 4.
    mesh = data_mesh(f"data={FAKE_DEVICES}")
    dcfg = cfg.draft_config(tcfg)
    tx, _ = make_optimizer(cfg)
    step, _ = make_steps(cfg, tcfg, dcfg, tx)
    batch = place(mesh, {k: jnp.asarray(v[:4]) for k, v in D.load_shards(root / "train").items()},
                  batch=True)
    assert batch["tokens"].sharding.shard_shape(batch["tokens"].shape)[0] == 1
    dp, st, tpp = place(mesh, (one.dparams, tx.init(one.dparams), tp))
    text = step.lower(dp, st, tpp, batch, jax.random.key(0)).as_text()
    assert '{"data"}' in text or f"devices=[{FAKE_DEVICES}," in text  # Shardy or GSPMD text


if __name__ == "__main__":
    child(Path(sys.argv[1]))
