#!/usr/bin/env bash
# Lint, format check and the whole CPU test suite, in the environment setup.sh made (.venv; PYTHON=...
# picks another). Run from anywhere; CI calls this.
#   TEST=1 bash setup.sh && bash unit_test_and_lint.sh [pytest arguments ...]
# About 38-40 minutes on 2 cores (37m52s of pytest on 2026-11-26), the slow tier (-m slow: AOT compiles of
# full-size models, multi-process faults, the Slurm job) included; `-m "not slow"` runs the rest.
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then  # as if activated: subprocesses that run `python3` get the venv too
    export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
  fi
  PYTHON=python3
fi
if ! "$PYTHON" -c 'import sys, pytest; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
  echo "unit_test_and_lint.sh: $PYTHON is not a Python >= 3.12 with the test tools; run 'TEST=1 bash setup.sh' first" >&2
  exit 1
fi
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
# Two workers fit a 2-core machine; each test process sees 8 fake CPU devices (conftest.py).
"$PYTHON" -m pytest MaxText/tests -n "${PYTEST_WORKERS:-2}" -m "not tpu and not gpu" --durations=15 "$@"
