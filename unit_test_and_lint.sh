#!/usr/bin/env bash
# Lint, format check and the CPU test suite, in the environment setup.sh made (.venv; PYTHON=... picks
# another). Run from anywhere; CI calls this with no arguments (the whole suite).
#   TEST=1 bash setup.sh && bash unit_test_and_lint.sh [pytest arguments ...]
# TIER picks the tests (README, "Testing", has the measured times):
#   TIER=quick  every entry point once and the core maths (pytest marker `quick`): target 3 minutes
#   TIER=fast   everything but the slow tier (-m "not slow"): target 10 minutes
#   TIER=all    (default) the whole suite, slow tier included: target 25 minutes
#   TIER=nightly  what a scheduled job runs beside the whole suite (pytest marker `nightly`, about 11 minutes):
#               the full-size AOT compiles for TPU topologies beyond llama2-7b's (the whole suite compiles their
#               reduced forms), the per-family consistency checks' other families, the post-training
#               walk-throughs and six of the loss fingerprint's cases (MaxText/tests/conftest.py, NIGHTLY)
#   TIER=torch  the live Hugging Face comparisons (pytest marker `torch`), against torch and transformers:
#               needs `TEST=1 TORCH=1 bash setup.sh`; the other tiers compare with committed reference files
# Tests share one persistent JAX compilation cache per session (MaxText/tests/conftest.py).
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")"
case "${TIER:-all}" in
  quick) select="quick and not tpu and not gpu" ;;
  fast) select="not slow and not tpu and not gpu" ;;
  all) select="not nightly and not tpu and not gpu" ;;
  nightly) select="nightly and not tpu and not gpu" ;;
  torch) select="torch and not tpu and not gpu" ;;
  *) echo "unit_test_and_lint.sh: TIER must be quick, fast, all, nightly or torch (got '$TIER')" >&2; exit 2 ;;
esac
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
if [ "${TIER:-all}" = torch ] && ! "$PYTHON" -c 'import torch, transformers' 2>/dev/null; then
  echo "unit_test_and_lint.sh: TIER=torch needs torch and transformers; run 'TEST=1 TORCH=1 bash setup.sh' first" >&2
  exit 1
fi
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
# Two workers fit a 2-core machine; each test process sees 8 fake CPU devices (conftest.py). loadgroup keeps the
# tests of a module that share a module-scoped fixture on one worker (conftest.py marks them).
"$PYTHON" -m pytest MaxText/tests -n "${PYTEST_WORKERS:-2}" --dist loadgroup -m "$select" --durations=15 "$@"
