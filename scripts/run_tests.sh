#!/usr/bin/env bash
# Run the test suite. pytest's exit code 5 (no tests collected) means the suite is
# broken here (rayrl has tests), so it fails loudly instead of passing silently.
#
# On a machine with a CUDA GPU the suite runs in two passes: every test not marked
# `cuda` with the GPU hidden (CPU semantics, as in CI), then the tests marked `cuda`
# with it visible. MARK adds a marker expression to both (make test-fast: "not slow").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
both() { if [ -n "${MARK:-}" ]; then echo "($1) and ($MARK)"; else echo "$1"; fi; }

run() {  # pytest with the 15 slowest listed (the suite's 20-minute budget)
  "$PY" -m pytest --durations=15 "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no tests: the suite is broken (imports? paths?)" >&2
    return 1
  fi
  return "$rc"
}

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "run_tests: a CUDA GPU is visible: first every test with it hidden, then the cuda tests"
  CUDA_VISIBLE_DEVICES= run -m "$(both 'not cuda')" "$@"
  first=$?
  run -m "$(both cuda)" "$@"
  second=$?
  [ "$first" -eq 0 ] && [ "$second" -eq 0 ]
  exit $?
fi
if [ -n "${MARK:-}" ]; then
  run -m "$MARK" "$@"
else
  run "$@"
fi
