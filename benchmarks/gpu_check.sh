#!/usr/bin/env bash
# The first thing to run on an NVIDIA GPU machine (H100/H200; under 8 minutes): the gpu-marked tests, cuDNN
# flash attention against dot_product on the same batch, fp8 matmuls, and the MFU of a llama2-7b-shaped model
# (8 layers, to fit one GPU) next to XLA's memory figure; a dated table in benchmarks/gpu/ (commit it).
#   DEVICE=gpu TEST=1 bash setup.sh && bash benchmarks/gpu_check.sh [--layers=8 --batch=2 --length=4096]
#   bash benchmarks/gpu_check.sh --smoke     # the same on this CPU with a tiny model: checks the script only
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
  export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
fi
case " $* " in *" --smoke "*) export JAX_PLATFORMS=cpu ;; *) export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}" ;; esac
exec "${PYTHON:-python3}" -m benchmarks.gpu_check "$@"
