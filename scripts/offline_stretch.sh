#!/usr/bin/env bash
# A stretch of the long run (scripts/long_run.sh) on a GPU machine that takes the checkout only
# as a copy per command and keeps files outside it only for a while between commands
# (docs/offline_gpu.md). After scripts/stage_smollm2.sh has staged the model, the prompts and
# the run's state (pack_smollm2.sh with STATE) in $JC:
#   DEADLINE=$(($(date +%s) + 1200)) bash scripts/offline_stretch.sh launch
#   bash scripts/offline_stretch.sh wait 550 OUTDIR   # in later commands, until it says done
#   bash scripts/offline_stretch.sh collect OUTDIR    # the new state, the logs (8 files)
# wait with OUTDIR leaves there what the stretch has so far, a state the next stretch can
# start from (the head of its last checkpoint, the log up to it): bring it back after every
# command, as the machine may be gone before the next one.
# launch copies the checkout to $JC/repo and starts the stretch there detached (setsid),
# so it outlives the command; its log is $JC/stretch.log. STEP_BENCH=1 first times the
# training step on the stretch's data (bench.train_step: the run's draft vocabulary, batch 32,
# the head's attention by XLA and by cuDNN; each variant's busiest ops in the log) into
# $JC/train_step.json.
# Settings: JC [$HOME/jc], DEADLINE (launch: the unix time by which training must end), and
# long_run.sh's own (SEQS, BATCH, ...).
set -euo pipefail
JC=${JC:-$HOME/jc}
LOG=$JC/stretch.log
PY=${PY:-python3}
DONE="the state of the run is now at step"

snapshot() {  # the stretch so far as a state folder: its last checkpoint's head and log
  local out=$1 head=$JC/run/jetspec/head tmp=$1.partial seed step
  [[ -f "$head/metadata.json" ]] || { echo "no checkpoint of this stretch yet"; return 0; }
  seed=$(sed -n 's/.*(data seed \([0-9]*\)).*/\1/p' "$LOG" | head -n 1)
  rm -rf "$tmp" && mkdir -p "$tmp"
  # On the CPU: the GPU is the trainer's. The trainer may swap in a newer head meanwhile: a
  # failed read says so and leaves the last snapshot; the next command's tries again.
  local -x JAX_PLATFORMS=cpu PYTHONPATH=$JC/pkgs:$JC/repo  # for this function only
  skip() { rm -rf "$tmp"; echo "warning: no snapshot this time (the head changed while read)"; }
  $PY -m jetspec_jax.cli convert --head "$head" "$tmp/head" --shard-mib 15 --dtype float32 \
    > /dev/null || { skip; return 0; }
  mv "$tmp"/head/* "$tmp/" && rmdir "$tmp/head"
  # The step of the weights just written, and the log up to it: later rows are not in them.
  step=$($PY - "$tmp" "$JC/run/jetspec/metrics.jsonl" <<'EOF2'
import json, sys
from pathlib import Path
from jetspec_jax.io.shards import read_shards
from jetspec_jax.train.trainer import read_metrics
out, log = Path(sys.argv[1]), sys.argv[2]
step = read_shards(sorted(out.glob("part-*.safetensors")))[3]["steps"]
rows = [r for r in read_metrics(log) if r["step"] <= step]
(out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
print(step)
EOF2
) || { skip; return 0; }
  cp "$JC/run/data/manifest.json" "$tmp/data-seed$seed.json"
  rm -rf "$out" && mv "$tmp" "$out"
  echo "snapshot: the head at step $step with its log in $out (a state to start from)"
}

case "${1:-}" in
  launch)
    : "${DEADLINE:?set DEADLINE, the unix time by which training must end}"
    [[ -f "$JC/prompts.jsonl" && -d "$JC/state" ]] \
      || { echo "error: stage the model, the prompts and the run's state in $JC first" >&2; exit 1; }
    src=$(cd "$(dirname "$0")/.." && pwd)
    rm -rf "$JC/repo" && mkdir -p "$JC/repo"
    tar -C "$src" --exclude=./.pack --exclude=./.venv --exclude=./runs -cf - . \
      | tar -C "$JC/repo" -xf -
    cd "$JC/repo"
    export PYTHONPATH=$JC/pkgs:$JC/repo JAX_COMPILATION_CACHE_DIR=$JC/xla
    setsid nohup env DEADLINE="$DEADLINE" PROMPTS="$JC/prompts.jsonl" RUN="$JC/run" \
      STATE="$JC/state" \
      PY="$PY" STEP_BENCH_OUT="${STEP_BENCH:+$JC/train_step.json}" \
      bash scripts/long_run.sh > "$LOG" 2>&1 < /dev/null &
    echo "stretch started (pid $!), training until $(date -d "@$DEADLINE" +%T); log $LOG"
    ;;
  wait)
    end=$(( $(date +%s) + ${2:?usage: offline_stretch.sh wait SECONDS} ))
    while (( $(date +%s) < end )) && ! grep -q "$DONE" "$LOG" 2>/dev/null; do
      pgrep -f scripts/long_run.sh > /dev/null || break  # ended without finishing: say so
      sleep 10
    done
    tail -n 15 "$LOG" | tr '\r' '\n' | tail -n 15  # the progress bar's updates as lines
    [[ -n "${3:-}" ]] && ! grep -q "$DONE" "$LOG" && snapshot "$3"
    if grep -q "$DONE" "$LOG"; then echo "STRETCH DONE"
    elif pgrep -f scripts/long_run.sh > /dev/null; then echo "STRETCH RUNNING"
    else echo "STRETCH FAILED (see $LOG)"; exit 1
    fi
    ;;
  collect)
    out=${2:?usage: offline_stretch.sh collect OUTDIR}
    grep -q "$DONE" "$LOG" || { echo "error: the stretch has not finished" >&2; exit 1; }
    mkdir -p "$out"
    newest=$(ls -t "$JC"/state/data-seed*.json | head -1)
    cp "$JC"/state/part-*.safetensors "$JC/state/metrics.jsonl" "$newest" "$LOG" "$out/"
    [[ -f "$JC/train_step.json" ]] && cp "$JC/train_step.json" "$out/"
    ls -l "$out"
    ;;
  *)
    echo "usage: offline_stretch.sh launch | wait SECONDS | collect OUTDIR" >&2
    exit 2
    ;;
esac
