#!/usr/bin/env bash
# One stretch of the SmolLM2 head's long training run: one schedule (STEPS, warm-up then cosine
# decay) continued stretch after stretch until it ends. The run's state lives in STATE (float32
# weights as safetensors parts, the training log): a stretch regenerates data with a seed of
# its own, trains from STATE's weights until DEADLINE, and writes the weights and the log back
# to STATE (written beside it, then moved in: an interrupted stretch leaves STATE as it was),
# with its data's manifest (data-seedN.json: sequences, tokens, generation and teacher seconds).
#   DEADLINE=$(($(date +%s) + 1800)) bash scripts/long_run.sh      # a 30-minute stretch
# The first stretch starts from the shipped head (checkpoints/smollm2-135m-jetspec), with a
# draft vocabulary picked from its data; later ones keep that vocabulary.
# Each stretch re-warms a fresh optimizer over WARMUP steps at the step it continues from.
# Settings from the environment [defaults]: STATE [checkpoints/smollm2-135m-jetspec-run]
#   RUN [runs/long-run] scratch folder  PROMPTS [the exported prompt file, required]
#   SEQS [30000] prompts per stretch (one greedy and one sampled answer each: ~21M tokens)
#   STEPS [40000]  BATCH [32]  LR [4e-4]  WARMUP [200]  PY [python3]
#   DRAFT_VOCAB_COVERAGE [0.995] the share of the first stretch's answer tokens it covers
#   STEP_BENCH_OUT [unset] a file: before training, time the step on this stretch's data
#   (bench.train_step: the stored top-K teacher and the run's draft vocabulary, batch 32, the
#   head's attention by XLA and by cuDNN) and print each variant's busiest device ops from a
#   traced step
#   TARGET_ATTENTION, HEAD_ATTENTION [train-draft's defaults] the target's and head's attention
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${STATE:-checkpoints/smollm2-135m-jetspec-run}
RUN=${RUN:-runs/long-run}
: "${DEADLINE:?set DEADLINE, the unix time by which training must end}"
: "${PROMPTS:?set PROMPTS, a prompt file from scripts/export_prompts.py}"
PY=${PY:-python3}
mkdir -p "$RUN"
steps_of() {  # the step the weights in these files were trained to
  $PY -c 'import sys; from jetspec_jax.io.shards import read_shards
print(read_shards(sys.argv[1:])[3]["steps"])' "$@"
}
parts=("$STATE"/part-*.safetensors)
if [[ -e "${parts[0]}" ]]; then
  init=("${parts[@]}")
  step=$(steps_of "${init[@]}")
  start=()
else  # the first stretch: the shipped head's weights, the schedule from step 0
  init=(checkpoints/smollm2-135m-jetspec)
  step=0
  start=(START_STEP=0)
fi
seed=$((1000 + step))  # a stretch's data seed: its first step, so no two stretches share one
echo "stretch from step $step (data seed $seed) until $(date -d "@$DEADLINE" +%T)"
if [[ ! -d "$RUN/jetspec/checkpoints" && -f "$STATE/metrics.jsonl" ]]; then
  mkdir -p "$RUN/jetspec" && cp "$STATE/metrics.jsonl" "$RUN/jetspec/metrics.jsonl"
fi
common=(RUN="$RUN" PY="$PY" PROMPTS="$PROMPTS")
env "${common[@]}" STAGES=data SEQS="${SEQS:-30000}" HELDOUT=128 MAX_PROMPT=512 MAX_NEW=512 \
  SAMPLES=1 SEED="$seed" TEACHER_TOP_K=32 GEN_BATCH=512 bash scripts/train_default_head.sh
if [[ -n "${STEP_BENCH_OUT:-}" ]]; then  # a failed benchmark does not cost the stretch
  vocab=$($PY -c 'import sys; from jetspec_jax.io.shards import read_shards
print(len(read_shards(sys.argv[1:])[1].get("draft_vocab") or []) or 16384)' "${parts[@]}" \
    2>/dev/null || echo 16384)
  $PY -m bench.train_step --data "$RUN/data" --vocab "$vocab" --batch 32 --steps 5 \
    --no-online --head-attention reference cudnn \
    --profile "$RUN/step-trace" --out "$STEP_BENCH_OUT" \
    || echo "warning: the step benchmark failed" >&2
fi
env "${common[@]}" "${start[@]}" STAGES=train INIT_HEAD="${init[*]}" STEPS="${STEPS:-40000}" \
  LR="${LR:-4e-4}" WARMUP="${WARMUP:-200}" GAMMA=3 DEPTH1_WEIGHT=3 LAYERS=3 BATCH="${BATCH:-32}" \
  ANCHORS=256 ANCHOR_CHUNK=32 DRAFT_VOCAB_COVERAGE="${DRAFT_VOCAB_COVERAGE:-0.995}" \
  EVAL_EVERY=1000 \
  TAU_PROMPTS=64 TAU_MAX_NEW=512 CKPT_EVERY=500 DEADLINE="$DEADLINE" \
  TARGET_ATTENTION="${TARGET_ATTENTION:-}" HEAD_ATTENTION="${HEAD_ATTENTION:-}" \
  bash scripts/train_default_head.sh
rm -rf "$RUN/export"
env "${common[@]}" STAGES=export EXPORT="$RUN/export" EXPORT_DTYPE=float32 SHARD_MIB=15 \
  bash scripts/train_default_head.sh
cp "$RUN/jetspec/metrics.jsonl" "$RUN/export/metrics.jsonl"
new="$STATE.new"
rm -rf "$new" && mkdir -p "$new"
cp "$RUN"/export/* "$new/"
[[ -f "$STATE/README.md" ]] && cp "$STATE/README.md" "$new/"
for f in "$STATE"/data-seed*.json; do [[ -f $f ]] && cp "$f" "$new/"; done
cp "$RUN/data/manifest.json" "$new/data-seed$seed.json"  # what each stretch trained on
rm -rf "$STATE.old"
[[ -d "$STATE" ]] && mv "$STATE" "$STATE.old"
mv "$new" "$STATE" && rm -rf "$STATE.old"
echo "the state of the run is now at step $(steps_of "$STATE"/part-*.safetensors) in $STATE"
