#!/usr/bin/env bash
# Create or reuse .venv and install rayrl with its pinned dependencies (CPU torch
# 2.13.0 from the pinned requirement). Re-installs only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" - <<'PYCHECK'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"rayrl needs Python >= 3.10; {sys.executable} is {sys.version.split()[0]} (set PYTHON=...)")
PYCHECK
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.rayrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing rayrl and its pinned dependencies into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
  touch "$stamp"
fi
# verl 0.9.1's wheel, read by the tests that compare rayrl's algorithms with verl's own
# functions (tests/algos/verl_core_algos.py); without a package index they skip.
if ! ls .cache/verl/verl-0.9.1-*.whl >/dev/null 2>&1; then
  mkdir -p .cache/verl
  .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps verl==0.9.1 \
    -d .cache/verl >/dev/null 2>&1 || echo "setup: verl 0.9.1's wheel not downloaded: its parity tests will skip"
fi
