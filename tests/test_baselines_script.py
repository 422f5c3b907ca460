"""scripts/train_baselines.sh: every head trains with the same settings and its own --head, each
is exported, a finished head is skipped, and bad input is refused before any run."""

from pathlib import Path

import pytest

from helpers import run_training_script


def _train(tmp_path: Path, heads: str | None, make_data: bool = True, **settings):
    env = {**({"HEADS": heads} if heads is not None else {}), **settings}
    return run_training_script(tmp_path, "train_baselines.sh", env, make_data)


def test_every_head_trains_with_the_same_settings_and_is_exported(tmp_path):
    done, calls = _train(tmp_path, None, STEPS="40", GAMMA="3", DEPTH1_WEIGHT="3")
    assert done.returncode == 0, done.stderr
    trains = sorted(c for c in calls if " train-draft " in c)
    exports = [c for c in calls if " convert " in c]
    heads = sorted(c.split("--head ")[1].split()[0] for c in trains)
    assert heads == ["dflash", "eagle", "jetspec"]
    # the lab's head trains and exports through the lab's command
    assert all(("-m lab " in c) == ("--head eagle " in c) for c in trains)
    for call in trains:  # the same data, steps and loss settings for every head
        assert f"--data {tmp_path}/run/data " in call and "--steps 40 " in call
        assert "--gamma 3 " in call and "--depth1-weight 3" in call
        assert "--head-layers 3 " in call and "--num-anchors 256 " in call
    for head in ("jetspec", "dflash", "eagle"):
        assert any(f"--head {tmp_path}/run/{head}/head {tmp_path}/run/{head}-export " in c
                   for c in exports), exports


def test_a_finished_head_is_skipped(tmp_path):
    _train(tmp_path, "dflash")
    done, calls = _train(tmp_path, "dflash eagle")
    assert done.returncode == 0, done.stderr
    assert "== dflash: done" in done.stdout
    trains = [c for c in calls if " train-draft " in c]
    assert len(trains) == 2 and "--head eagle " in trains[1]


@pytest.mark.parametrize("heads, data, message", [
    ("jetspec medusa", True, "unknown head 'medusa'"),
    ("jetspec", False, "data or"),
])
def test_bad_input_is_refused_before_any_run(tmp_path, heads, data, message):
    done, calls = _train(tmp_path, heads, make_data=data)
    assert done.returncode == 1 and message in done.stderr and calls == []
