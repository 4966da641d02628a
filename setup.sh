#!/usr/bin/env bash
# Idempotent install into .venv, made with Python >= 3.12. DEVICE=cpu (default) | gpu | tpu.
# TEST=1 also installs the test/lint tools (no torch and no nvidia package). TORCH=1 installs torch, transformers
# and torchvision (requirements-torch.txt): the live Hugging Face comparisons (pytest -m torch) only.
# GPU_AOT=1 installs requirements-gpu-aot.txt into .venv/gpu-aot, apart:
# `PYTHONPATH=.venv/gpu-aot python3 MaxText/train_compile.py ... compile_topology=a3mega` then compiles for
# NVIDIA GPUs on this machine, without a GPU (docs/aot.md, "GPU targets").
#   bash setup.sh && source .venv/bin/activate   # CPU
#   DEVICE=tpu bash setup.sh                      # or MaxText's form: bash setup.sh DEVICE=tpu [TEST=1] [TORCH=1]
# The Python: PYTHON=/path/to/python3.12 if given, else the first of python3.12, python3.13, python3
# (on PATH) and pyenv's installed 3.12+ versions that runs and is 3.12 or newer. jax 0.11 and newer,
# which this project pins, are not published for older Pythons. VENV=DIR installs into an existing
# environment of yours instead (a conda env, your own venv). Ends with this repository installed
# editable: `from MaxText import ...` and the maxtext-train / maxtext-decode / maxtext-train-compile
# commands work from any directory once the environment is active.
set -euo pipefail
cd "$(dirname "$0")"
for arg in "$@"; do  # KEY=VALUE arguments, as MaxText's setup.sh takes them
  case "$arg" in
    DEVICE=*|TEST=*|TORCH=*|GPU_AOT=*|PYTHON=*|VENV=*) export "${arg?}" ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (takes DEVICE=cpu|gpu|tpu, TEST=1, TORCH=1, GPU_AOT=1, PYTHON=..., VENV=...)" >&2; exit 2 ;;
  esac
done
DEVICE="${DEVICE:-cpu}"
say() { echo "setup.sh: $*"; }
fail() { echo "setup.sh: $*" >&2; exit 1; }
case "$DEVICE" in
  cpu|gpu|tpu) ;;
  *) fail "DEVICE must be cpu, gpu or tpu (got '$DEVICE')" ;;
esac

version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
find_python() {  # prints the path of the first Python >= 3.12; a pyenv shim counts only if it runs
  local c
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null && new_enough "$c"; then command -v "$c"; return 0; fi
  done
  for c in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V); do
    if new_enough "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [ -n "${VENV:-}" ]; then  # the user's own environment
  [ -x "$VENV/bin/python" ] || fail "VENV=$VENV has no bin/python; make it first (python3.12 -m venv $VENV)"
  new_enough "$VENV/bin/python" || fail "VENV=$VENV has Python $(version_of "$VENV/bin/python"); this project needs >= 3.12"
else
  VENV=.venv
  if [ -x .venv/bin/python ] && ! new_enough .venv/bin/python; then
    say ".venv has Python $(version_of .venv/bin/python), older than the 3.12 this project needs: making it anew"
    rm -rf .venv
  fi
  if [ ! -x .venv/bin/python ]; then
    if [ -n "${PYTHON:-}" ]; then
      new_enough "$PYTHON" || fail "PYTHON=$PYTHON is not a Python >= 3.12 (it is $(version_of "$PYTHON" || echo 'not runnable'))"
    else
      PYTHON="$(find_python)" || fail "no Python >= 3.12 found (python3 is $(version_of python3 || echo missing)); install one (pyenv install 3.12, apt-get install python3.12, or uv python install 3.12) and run again, or pass PYTHON=/path/to/python3.12"
    fi
    say "making .venv with Python $(version_of "$PYTHON") ($PYTHON)"
    "$PYTHON" -m venv .venv
  fi
  if [ -n "${VIRTUAL_ENV:-}" ] && [ "$VIRTUAL_ENV" != "$PWD/.venv" ]; then
    say "note: installing into .venv, not the active $VIRTUAL_ENV (VENV=\$VIRTUAL_ENV installs there)"
  fi
fi
PY="$VENV/bin/python"
say "installing for DEVICE=$DEVICE into $VENV (Python $(version_of "$PY"))"

say "upgrading pip"
"$PY" -m pip install --quiet --upgrade pip
say "runtime dependencies (requirements.txt: jax, flax, optax, orbax, data and tokenizer libraries, tensorboard)"
"$PY" -m pip install --quiet -r requirements.txt
case "$DEVICE" in
  cpu) ;;
  gpu) say "jax[cuda12] (requirements-gpu.txt: CUDA 12 wheels, cuDNN, NCCL)"
       "$PY" -m pip install --quiet -r requirements-gpu.txt ;;
  tpu) say "libtpu (requirements-tpu.txt)"
       "$PY" -m pip install --quiet -r requirements-tpu.txt ;;
esac
if [ "${TEST:-0}" = "1" ]; then
  say "test and lint tools (requirements-test.txt: pytest, ruff; no torch)"
  "$PY" -m pip install --quiet -r requirements-test.txt
  say "libtpu: tests compile for TPU topologies on the CPU"
  "$PY" -m pip install --quiet -r requirements-tpu.txt
  if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null; then
    say "openssh-server: the multi-host runner's tests use sshd on 127.0.0.1 as remote hosts"
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server openssh-client
  fi
  if [ "$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null && [ ! -x /usr/sbin/slurmctld ] && command -v apt-get >/dev/null; then
    say "slurm-wlm and munge: the Slurm launcher's tests start a one-node Slurm on 127.0.0.1 (as root)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
fi
if [ "${TORCH:-0}" = "1" ]; then
  say "torch, transformers and torchvision (requirements-torch.txt: the live Hugging Face comparisons, pytest -m torch)"
  "$PY" -m pip install --quiet -r requirements-torch.txt
fi
if [ "${GPU_AOT:-0}" = "1" ]; then
  # Apart from the venv's own packages: on the path, JAX's CUDA plugin loads in every jax program and, with
  # no GPU, prints CUDA errors at start. Skipped when $VENV/gpu-aot already holds this requirements file.
  if cmp -s requirements-gpu-aot.txt "$VENV/gpu-aot/requirements-gpu-aot.txt"; then
    say "GPU AOT compiler: $VENV/gpu-aot is up to date"
  else
    say "GPU AOT compiler (requirements-gpu-aot.txt: JAX's CUDA plugin, ptxas, libdevice, cuDNN; ~630 MB) into $VENV/gpu-aot"
    rm -rf "$VENV/gpu-aot"
    "$PY" -m pip install --quiet --no-deps --target "$VENV/gpu-aot" -r requirements-gpu-aot.txt
    cp requirements-gpu-aot.txt "$VENV/gpu-aot/"
  fi
fi
say "this repository, editable (pip install -e .)"
# setuptools warns of same-named folders in the working directory on every editable build (a framed banner):
# that is this repository's layout by design (MaxText/ is the package), so the notice is kept out.
PYTHONWARNINGS="ignore:Editable installation" "$PY" -m pip install --quiet --no-deps -e .
"$PY" -c "import MaxText, jax; print('setup.sh: done: jax', jax.__version__, 'on', jax.default_backend(), jax.devices())"
[ "$VENV" = .venv ] && [ "${VIRTUAL_ENV:-}" != "$PWD/.venv" ] && say "activate it with: source .venv/bin/activate"
exit 0
