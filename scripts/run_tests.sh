#!/usr/bin/env bash
# Run the test suite. pytest's exit code 5 (no tests collected) means the suite is
# broken here (rayrl has tests), so it fails loudly instead of passing silently.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest --durations=15 "$@"  # the slowest, to keep the suite under 20 min
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests: the suite is broken (imports? paths?)" >&2
  exit 1
fi
exit "$rc"
