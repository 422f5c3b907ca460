#!/usr/bin/env bash
# Trains the comparison heads side by side on one GPU, with the shipped head's data
# and settings (scripts/train_default_head.sh made both): the DFlash (bidirectional) head and the
# EAGLE-style head by default. Every run resumes from its checkpoints.
#   RUN=runs/default-head MODEL=smollm2-135m TIME_LIMIT=7 bash scripts/train_baselines.sh
# Settings from the environment (defaults in brackets): RUN [runs/default-head] holding data/ and
# heldout/; HEADS [dflash eagle]; MODEL [smollm2-135m]; STEPS [2400]; TIME_LIMIT [none] minutes
# of training per head; MEM [0.45] share of GPU memory per process (they share one GPU).
set -euo pipefail
RUN=${RUN:-runs/default-head}
PY=${PY:-python3}
limit=()
[[ -n "${TIME_LIMIT:-}" ]] && limit=(--time-limit "$TIME_LIMIT")
pids=()
for head in ${HEADS:-dflash eagle}; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM:-0.45} $PY -m jetspec_jax.cli train-draft \
      --model "${MODEL:-smollm2-135m}" --data "$RUN/data" --eval-data "$RUN/heldout" \
      --out "$RUN/$head" --head "$head" --head-layers 2 --block-size 16 --batch-size 32 \
      --num-anchors 64 --steps "${STEPS:-2400}" --lr 6e-4 --eval-every 600 --ckpt-every 300 \
      --dtype bfloat16 "${limit[@]}" > "$RUN/$head.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
