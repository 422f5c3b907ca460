#!/usr/bin/env bash
# Builds llama.cpp's own tools from a source tarball, for the peer benchmark
# (bench/peers/llama_cpp.py): llama-bench, llama-completion, llama-simple, llama-lookup and
# llama-speculative-simple, nothing else (the server, its web UI and the tests are most of a
# full build's time).
#   bash scripts/build_llama_cpp.sh cuda SRC [OUT]   # GPU: sm_90 only (H100/H200)
#   bash scripts/build_llama_cpp.sh cpu SRC [OUT]    # CPU: tuned for this machine's cores
#   bash scripts/build_llama_cpp.sh pack SRC [FOLDER]
# SRC: a llama.cpp source tarball (or an unpacked folder). Either of:
#   - a release's "Source code (tar.gz)" from the ggml-org/llama.cpp repository on GitHub;
#   - the llama-cpp-python sdist, which carries llama.cpp in vendor/llama.cpp:
#     pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
# The tools land in OUT/bin (default build/llama-cpp-<kind>); OUT/source.txt names the
# source they were built from.
# `pack` writes, for a machine without network access, FOLDER (default .pack/llama) with a
# trimmed tar.xz of the sources the build needs (no docs, vocab files, tests or web UI) and
# the cmake wheel; there, `build_llama_cpp.sh cuda FOLDER/llama_cpp_src.tar.xz` takes cmake
# from that wheel when none is installed.
# ARCH overrides the CUDA architectures (default 90); JOBS the build jobs (default nproc).
set -euo pipefail
kind=${1:?usage: build_llama_cpp.sh cuda|cpu|pack SRC [OUT]}
src=${2:?usage: build_llama_cpp.sh cuda|cpu|pack SRC [OUT]}
cd "$(dirname "$0")/.."
TOOLS=(llama-bench llama-completion llama-simple llama-lookup llama-speculative-simple)

unpacked=
if [ -f "$src" ]; then
  unpacked=$(mktemp -d)
  trap 'rm -rf "$unpacked"' EXIT
  tar xf "$src" -C "$unpacked"
  search=$unpacked
else
  search=$src
fi
# The llama.cpp root: the folder holding include/llama.h (at the top of a release tarball,
# under vendor/llama.cpp in the sdist).
root=$(dirname "$(dirname "$(find "$search" -path '*/include/llama.h' -not -path '*/ggml/*' \
  | head -1)")")
[ -f "$root/CMakeLists.txt" ] && [ -d "$root/ggml" ] \
  || { echo "error: no llama.cpp sources (include/llama.h) in $src" >&2; exit 1; }

if [ "$kind" = pack ]; then
  dir=${3:-.pack/llama}
  out=$dir/llama_cpp_src.tar.xz
  mkdir -p "$dir"
  rm -f "$dir"/cmake-*.whl
  python3 -m pip download -q --no-deps --only-binary :all: cmake -d "$dir"
  # Only what configuring and building the tools reads: the backends other than CPU and
  # CUDA, the docs, the vocab GGUFs under models/ and the web UI are left out.
  base=$(basename "$root")
  # Anchored at the top: src/models (the model graphs) must stay.
  tar cJf "$out" -C "$(dirname "$root")" --anchored \
    --exclude="$base/"{docs,models,media,tools/ui,examples/llama.android,examples/llama.swiftui} \
    --exclude="$base/ggml/src/ggml-"{sycl,vulkan,opencl,metal,hexagon,cann,musa,webgpu} \
    --exclude="$base/ggml/src/ggml-"{zdnn,et,openvino,virtgpu,zendnn} \
    "$base"
  du -b "$dir"/*
  exit 0
fi

out=${3:-build/llama-cpp-$kind}
case $kind in
  cuda)
    # nvcc: on PATH, in the CUDA toolkit, or in the pip wheel the JAX CUDA plugin brings.
    nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null \
      || python3 -c 'import glob, site; print(next(iter(sorted(
           glob.glob(site.getsitepackages()[0] + "/nvidia/*/bin/nvcc"))), ""))')
    [ -x "$nvcc" ] || { echo "error: no nvcc found for the CUDA build" >&2; exit 1; }
    flags=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${ARCH:-90}" "-DCMAKE_CUDA_COMPILER=$nvcc"
           -DGGML_NATIVE=OFF) ;;
  cpu)
    flags=(-DGGML_CUDA=OFF -DGGML_NATIVE=ON) ;;
  *) echo "error: kind must be cuda, cpu or pack, got $kind" >&2; exit 1 ;;
esac
if ! command -v cmake >/dev/null; then
  # The wheel `pack` put beside the tarball: a zip whose data/bin holds cmake itself.
  wheel=$(ls "$(dirname "$src")"/cmake-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "error: no cmake, and no cmake wheel beside $src" >&2; exit 1; }
  python3 -m zipfile -e "$wheel" "$HOME/.cmake-wheel"
  bin=$(dirname "$(find "$HOME/.cmake-wheel" -path '*/bin/cmake' | head -1)")
  chmod +x "$bin"/*
  export PATH=$bin:$PATH
fi
mkdir -p "$(dirname "$out")"
start=$(date +%s)
cmake -S "$root" -B "$out" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF "${flags[@]}" \
  > "$out.cmake.log" \
  || { tail -30 "$out.cmake.log" >&2; exit 1; }
cmake --build "$out" -j "${JOBS:-$(nproc)}" --target "${TOOLS[@]}" > "$out.build.log" 2>&1 \
  || { tail -40 "$out.build.log" >&2; exit 1; }
for t in "${TOOLS[@]}"; do
  [ -x "$out/bin/$t" ] || { echo "error: $out/bin/$t was not built" >&2; exit 1; }
done
echo "$(basename "$src") ($kind, built $(date -u +%F) in $(( $(date +%s) - start )) s)" \
  > "$out/source.txt"
echo "built ${TOOLS[*]} in $out/bin in $(( $(date +%s) - start )) s"
