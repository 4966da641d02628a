#!/usr/bin/env bash
# Lint, format check and the whole CPU test suite. Run from anywhere; CI calls this.
#   bash unit_test_and_lint.sh [pytest arguments ...]   # about 9-10 minutes on 2 cores (the slow tier: ~5)
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
# Two workers fit a 2-core machine; each test process sees 8 fake CPU devices (conftest.py).
"$PYTHON" -m pytest MaxText/tests -n "${PYTEST_WORKERS:-2}" -m "not tpu and not gpu" --durations=15 "$@"
