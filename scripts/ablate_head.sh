#!/usr/bin/env bash
# Short training runs of head variants on one data set, each from scratch for the same number
# of steps, compared by held-out tau at the end (scripts/train_default_head.sh's evaluation:
# 64 prompts, 64 tokens, budget 64). Each variant trains in RUN/ablate/NAME and shares
# RUN/data and RUN/heldout (make them with STAGES=data of train_default_head.sh). A variant
# cut off by DEADLINE resumes from its checkpoint on the next call; a finished one is skipped.
# Then the table: python -m bench.ablation_table RUN/ablate --out ablation.json
#   RUN=runs/ablate STEPS=300 DEADLINE=$(($(date +%s)+540)) bash scripts/ablate_head.sh
# VARIANTS (default: all, in this order) picks among:
#   base       3 layers, block 16, 256 anchors, gamma 7 (train_default_head.sh's defaults)
#   layers5    LAYERS=5              layers2    LAYERS=2
#   anchors64  ANCHORS=64            gamma3     GAMMA=3
#   block8     BLOCK=8               norm       NORM_FROM_TARGET=1
#   depth1     DEPTH1_WEIGHT=3 (depth 1's loss weight 3 instead of 1)
#   xla_attn   HEAD_ATTENTION=reference (XLA's float32 attention where base takes cuDNN's on a
#              GPU: held-out tau after the same tokens; not in the default list)
# Other settings (STEPS [300], WARMUP [STEPS/10], BATCH, LR, ...) pass through to every variant.
# A variant needs about MIN_LEFT [150] seconds: with less left before DEADLINE it is not begun.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/ablate}
STEPS=${STEPS:-300}
VARIANTS=${VARIANTS:-base layers5 layers2 anchors64 gamma3 block8 norm depth1}
[[ -d "$RUN/data" && -d "$RUN/heldout" ]] \
  || { echo "error: $RUN/data or $RUN/heldout is missing: run train_default_head.sh STAGES=data first" >&2; exit 1; }

settings() {
  case $1 in
    base) ;;
    layers5) echo LAYERS=5 ;;
    layers2) echo LAYERS=2 ;;
    anchors64) echo ANCHORS=64 ;;
    gamma3) echo GAMMA=3 ;;
    block8) echo BLOCK=8 ;;
    norm) echo NORM_FROM_TARGET=1 ;;
    depth1) echo DEPTH1_WEIGHT=3 ;;
    xla_attn) echo HEAD_ATTENTION=reference ;;
    *) echo "error: unknown variant '$1' (see the header of $0)" >&2; return 1 ;;
  esac
}
for name in $VARIANTS; do settings "$name" > /dev/null; done  # every name checked before any run

for name in $VARIANTS; do
  dir=$RUN/ablate/$name
  if grep -qs '"complete": true' "$dir/jetspec/head/metadata.json"; then
    echo "== $name: done"
    continue
  fi
  if [[ -n "${DEADLINE:-}" ]] && (( DEADLINE - $(date +%s) < ${MIN_LEFT:-150} )); then
    echo "== $name: not begun, too little time before DEADLINE"
    continue
  fi
  mkdir -p "$dir"
  ln -sfn "$(realpath "$RUN/data")" "$dir/data"
  ln -sfn "$(realpath "$RUN/heldout")" "$dir/heldout"
  echo "== $name: $(settings "$name")"
  # shellcheck disable=SC2046  # the variant's settings are words NAME=VALUE
  env $(settings "$name") RUN="$dir" STAGES=train STEPS="$STEPS" WARMUP="${WARMUP:-$((STEPS / 10))}" \
    EVAL_EVERY="$STEPS" CKPT_EVERY="${CKPT_EVERY:-100}" bash scripts/train_default_head.sh
done
