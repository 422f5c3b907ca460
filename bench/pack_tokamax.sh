#!/usr/bin/env bash
# Packs tokamax 0.0.17 and the pure-Python packages it imports that the GPU image lacks into
# one tarball, so that bench/bench_attention.py can time tokamax's attention beside ours
# (issue 4). The device has no network: carry the tarball, then on the device
#   mkdir -p $HOME/tkm && tar xzf .carry/tokamax/tokamax-site.tgz -C $HOME/tkm
#   PYTHONPATH=$HOME/tkm python3 bench/bench_attention.py ...
# (bench_attention adds the "tokamax" and "tokamax_mosaic" variants when tokamax imports).
#
# xprof (100 MB) is replaced by a stand-in module: tokamax imports one name from it, for its
# own benchmarking helper, which bench_attention does not call. Checked on the CPU with jax
# 0.11.2: tokamax imports and its attention matches jax.nn.dot_product_attention.
#
#   bash bench/pack_tokamax.sh [OUT.tgz]     (default .carry/tokamax/tokamax-site.tgz)
set -euo pipefail
out=${1:-.carry/tokamax/tokamax-site.tgz}
python=${PYTHON:-.venv/bin/python}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT

"$python" -m pip install -q --no-deps --target "$site" tokamax==0.0.17 einshape immutabledict \
    qwix jaxtyping wadler-lindig fire termcolor six tensorboardx pydantic pydantic-core \
    annotated-types typing-inspection
mkdir -p "$site/xprof/cli"
: > "$site/xprof/__init__.py"
: > "$site/xprof/cli/__init__.py"
cat > "$site/xprof/cli/tools.py" <<'PY'
"""Stand-in for xprof on the device (see bench/pack_tokamax.sh)."""


def get_kernel_stats_tool(*args, **kwargs):
    raise RuntimeError("xprof is not installed here: a stand-in from bench/pack_tokamax.sh")
PY
rm -rf "$site/bin"
mkdir -p "$(dirname "$out")"
tar czf "$out.tmp" -C "$site" .
mv "$out.tmp" "$out"
echo "wrote $out ($(du -h "$out" | cut -f1))"
