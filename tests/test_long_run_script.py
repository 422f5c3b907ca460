"""scripts/long_run.sh: the first stretch starts from the shipped head at step 0, a later one
from the run's own weights at their step, each with a data seed of its own; the run's state is
replaced only when a stretch finished, and its log carries over. scripts/offline_stretch.sh
leaves a running stretch's last checkpoint as a state to start from."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import tiny_head, tiny_target
from jetspec_jax.io.heads import save_draft
from jetspec_jax.io.shards import read_shards

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for python: records the CLI calls; `-c` (the step of a state's weights) prints
# $TRAINED; train-draft writes a metrics row; convert writes one weights part.
FAKE_PY = """#!/usr/bin/env bash
if [[ $1 == -c ]]; then echo "$TRAINED"; exit 0; fi
echo "$@" >> "$CALLS"
out=$(echo "$@" | sed -n 's/.*--out \\([^ ]*\\).*/\\1/p')
case $3 in
  train-data) mkdir -p "$out" && echo '{"num_seqs": 2}' > "$out/manifest.json" ;;
  train-draft) mkdir -p "$out" && echo '{"step": 1}' >> "$out/metrics.jsonl" ;;
  convert) [[ -n "${FAIL_EXPORT:-}" ]] && exit 3
           dst=$(echo "$@" | awk '{print $6}'); mkdir -p "$dst"
           echo weights > "$dst/part-00001-of-00001.safetensors" ;;
esac
"""


def stretch(tmp_path: Path, **env):
    py = tmp_path / "py"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "long_run.sh")], capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "PY": str(py), "CALLS": str(calls),
             "STATE": str(tmp_path / "state"), "RUN": str(tmp_path / "run"),
             "PROMPTS": "prompts.jsonl", "DEADLINE": "4102444800", "TRAINED": "0", **env})
    return done, (calls.read_text().splitlines() if calls.exists() else [])


def test_stretches_continue_one_run(tmp_path):
    done, calls = stretch(tmp_path)
    assert done.returncode == 0, done.stderr
    data = [c for c in calls if " train-data " in c and "--split train" in c]
    train = [c for c in calls if " train-draft " in c]
    assert len(data) == 1 and "--seed 1000 " in data[0] and "--teacher-top-k 32" in data[0]
    assert "--max-prompt-len 512 " in data[0] and "--max-new-tokens 512 " in data[0]
    assert len(train) == 1 and "--init-head checkpoints/smollm2-135m-jetspec " in train[0]
    assert "--start-step 0" in train[0] and "--steps 40000 " in train[0]
    assert "--draft-vocab-coverage 0.995" in train[0]
    state = tmp_path / "state"
    assert (state / "part-00001-of-00001.safetensors").exists()
    assert (state / "metrics.jsonl").read_text().count("step") == 1
    assert (state / "data-seed1000.json").read_text().strip() == '{"num_seqs": 2}'

    (tmp_path / "run").rename(tmp_path / "run-1")  # a later stretch, on a fresh machine
    done, calls = stretch(tmp_path, TRAINED="5000")
    assert done.returncode == 0, done.stderr
    data = [c for c in calls if " train-data " in c and "--split train" in c]
    train = [c for c in calls if " train-draft " in c]
    assert "--seed 6000 " in data[0]
    assert f"--init-head {state}/part-00001-of-00001.safetensors" in train[0]
    assert "--start-step" not in train[0]
    assert (state / "metrics.jsonl").read_text().count("step") == 2  # the log carried over
    assert {p.name for p in state.glob("data-*.json")} == {"data-seed1000.json",
                                                            "data-seed6000.json"}


def test_an_unfinished_stretch_leaves_the_state(tmp_path):
    stretch(tmp_path)
    before = (tmp_path / "state" / "metrics.jsonl").read_text()
    (tmp_path / "run").rename(tmp_path / "run-1")
    done, _ = stretch(tmp_path, TRAINED="5000", FAIL_EXPORT="1")
    assert done.returncode != 0
    assert (tmp_path / "state" / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        "data-seed1000.json", "metrics.jsonl", "part-00001-of-00001.safetensors"]


def test_settings_are_required(tmp_path):
    done, calls = stretch(tmp_path, DEADLINE="")
    assert done.returncode != 0 and "DEADLINE" in done.stderr and not calls


def test_wait_leaves_the_stretch_so_far_as_a_state(tmp_path):
    """`offline_stretch.sh wait SECONDS OUT` on a stretch that has checkpointed (here one no
    longer running, so it reports a failure): OUT holds its last checkpoint's head in float32
    parts, the log up to that step and the data's manifest: a state long_run.sh starts from."""
    jc, out = tmp_path / "jc", tmp_path / "out"
    run = jc / "run"
    dcfg, dparams = tiny_head(tiny_target()[0])
    save_draft(run / "jetspec" / "head", dparams, dcfg, metadata={"steps": 500, "complete": False})
    (run / "jetspec" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (400, 500, 510)))
    (run / "data").mkdir()
    (run / "data" / "manifest.json").write_text('{"num_seqs": 2}')
    (jc / "stretch.log").write_text("stretch from step 0 (data seed 1000) until 01:00:00\n")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "offline_stretch.sh"), "wait", "0", str(out)],
        capture_output=True, text=True, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "JC": str(jc), "PY": sys.executable})
    assert done.returncode == 1 and "STRETCH FAILED" in done.stdout, done.stdout + done.stderr
    parts = sorted(out.glob("part-*.safetensors"))
    assert parts and read_shards(parts)[3]["steps"] == 500
    rows = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(row)["step"] for row in rows]
    assert steps == [400, 500]  # the row past the checkpoint is not in the head
    assert (out / "data-seed1000.json").read_text() == '{"num_seqs": 2}'
