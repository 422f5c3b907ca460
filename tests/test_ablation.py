"""scripts/ablate_head.sh (each variant's flags reach train-draft, bad input is refused before
any run, a finished variant is skipped) and its table (bench/ablation_table.py)."""

import json
import sys
from pathlib import Path

import pytest

from bench import ablation_table
from helpers import run_training_script


def _ablate(tmp_path: Path, variants: str, make_data: bool = True):
    return run_training_script(tmp_path, "ablate_head.sh", {"VARIANTS": variants, "STEPS": "40"},
                               make_data)


def test_each_variant_passes_its_own_flags_to_train_draft(tmp_path):
    done, calls = _ablate(tmp_path, "base layers5 anchors64 gamma3 block8 norm depth1")
    assert done.returncode == 0, done.stderr
    assert len(calls) == 7 and all(c.startswith("-m jetspec_jax.cli train-draft") for c in calls)
    base, layers5, anchors64, gamma3, block8, norm, depth1 = calls
    assert "--head-layers 3 " in base and "--head-layers 5 " in layers5
    assert "--num-anchors 256 " in base and "--num-anchors 64 " in anchors64
    assert "--gamma 7 " in base and "--gamma 3 " in gamma3
    assert "--block-size 16 " in base and "--block-size 8 " in block8
    assert "--norm-from-target" in norm and "--norm-from-target" not in base
    assert "--depth1-weight 3" in depth1 and "--depth1-weight" not in base
    (xla_attn,) = _ablate(tmp_path / "step", "xla_attn")[1]
    assert "--head-attention reference" in xla_attn and "--head-attention" not in base
    for call in calls:  # the same steps, warm-up and held-out evaluation at the end for all
        assert "--steps 40 " in call and "--warmup-steps 4 " in call and "--eval-every 40 " in call
    assert f"--out {tmp_path}/run/ablate/layers5/jetspec " in layers5


def test_a_finished_variant_is_skipped(tmp_path):
    _ablate(tmp_path, "base")
    done, calls = _ablate(tmp_path, "base layers2")
    assert done.returncode == 0, done.stderr
    assert "== base: done" in done.stdout
    assert len(calls) == 2 and "--head-layers 2 " in calls[1]  # the first call was base's


@pytest.mark.parametrize("variants, data, message", [
    ("base layers9", True, "unknown variant 'layers9'"),
    ("base", False, "run/data or"),
])
def test_bad_input_is_refused_before_any_run(tmp_path, variants, data, message):
    done, calls = _ablate(tmp_path, variants, make_data=data)
    assert done.returncode != 0 and message in done.stderr
    assert calls == []


def _variant(root: Path, name: str, tau: float | None, layers: int, steps: int = 40):
    run = root / name / "jetspec"
    (run / "head").mkdir(parents=True)
    rows = [{"step": 20, "loss": 2.0, "step_s": 0.30},
            {"step": steps, "loss": 1.5, "step_s": 0.34,
             **({"eval": {"tau": tau, "kl": [0.1 * d for d in range(1, 16)]}} if tau else {})}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"complete": tau is not None, "train_config": {"head_layers": layers, "steps": 40}}
    (run / "head" / "metadata.json").write_text(json.dumps(meta))


def test_table_ranks_by_tau_and_lists_unfinished_runs(tmp_path, capsys, monkeypatch):
    root = tmp_path / "ablate"
    _variant(root, "base", 2.5, 3)
    _variant(root, "layers5", 2.7, 5)
    _variant(root, "layers2", None, 2, steps=20)
    out = tmp_path / "ablation.json"
    monkeypatch.setattr(sys, "argv", ["ablation_table", str(root), "--out", str(out)])
    ablation_table.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| layers5 | 2.700 | 0.100 / 0.800 / 1.500 | 0.340")
    assert lines[3].startswith("| base | 2.500")
    assert lines[4] == "| layers2 | unfinished (step 20) | - | - |"
    saved = {v["variant"]: v for v in json.loads(out.read_text())["variants"]}
    assert saved["layers5"]["settings"]["head_layers"] == 5 and len(saved["base"]["log"]) == 2


def test_table_refuses_a_folder_without_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ablation_table", str(tmp_path)])
    with pytest.raises(SystemExit, match="holds no variant"):
        ablation_table.main()
