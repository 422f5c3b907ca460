#!/usr/bin/env bash
# Trains draft heads side by side on one GPU, from scratch, on the same data and with the same
# settings: the JetSpec head and its baselines, the DFlash (bidirectional) head and the
# EAGLE-style head. Each head is scripts/train_default_head.sh's "train export" stages with
# HEAD set, so every setting of that script (LAYERS, ANCHORS, GAMMA, DEPTH1_WEIGHT, STEPS, LR,
# DEADLINE, ...) reaches every head alike. A head cut off by the deadline resumes from its
# checkpoint on the next call; a finished one is skipped.
#   RUN=runs/compare STEPS=900 GAMMA=3 DEPTH1_WEIGHT=3 DEADLINE=$(($(date +%s)+540)) \
#     bash scripts/train_baselines.sh
# RUN [runs/default-head] holds data/ and heldout/ (train_default_head.sh STAGES=data makes
# them); head H trains in RUN/H and is exported to RUN/H-export; its log is RUN/H.log.
# HEADS [jetspec dflash eagle]; MEM [0.9 / number of heads] share of GPU memory per process.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/default-head}
read -r -a heads <<< "${HEADS:-jetspec dflash eagle}"
for head in "${heads[@]}"; do
  [[ $head == jetspec || $head == dflash || $head == eagle ]] \
    || { echo "error: unknown head '$head' in HEADS (jetspec, dflash or eagle)" >&2; exit 1; }
done
[[ -d "$RUN/data" && -d "$RUN/heldout" ]] \
  || { echo "error: $RUN/data or $RUN/heldout is missing: run train_default_head.sh STAGES=data first" >&2; exit 1; }
mem=${MEM:-$(awk -v n="${#heads[@]}" 'BEGIN {printf "%.2f", 0.9 / n}')}

pids=()
for head in "${heads[@]}"; do
  if grep -qs '"complete": true' "$RUN/$head/head/metadata.json"; then
    echo "== $head: done"
    continue
  fi
  echo "== $head: training, log $RUN/$head.log"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$mem HEAD=$head STAGES="train export" RUN="$RUN" \
    EXPORT="$RUN/$head-export" bash scripts/train_default_head.sh >> "$RUN/$head.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
