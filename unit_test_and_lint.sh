#!/usr/bin/env bash
# Lint, format check and the whole CPU test suite. Run from anywhere; CI calls this.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
# Two workers fit a 2-core machine; each test process sees 8 fake CPU devices (conftest.py).
"$PYTHON" -m pytest MaxText/tests -n "${PYTEST_WORKERS:-2}" -m "not tpu and not gpu" --durations=15 "$@"
