#!/usr/bin/env bash
# Idempotent install. DEVICE=cpu (default) | gpu | tpu. TEST=1 also installs the test/lint tools.
#   bash setup.sh                     # CPU
#   DEVICE=tpu bash setup.sh          # or MaxText's form: bash setup.sh DEVICE=tpu [TEST=1]
# Installs into the active Python environment (a venv, conda, or a user-writable Python); where the
# system Python is externally managed (PEP 668) and no venv is active, it creates .venv and says so.
# Ends with this repository installed editable (pip install -e .): `from MaxText import ...` and the
# maxtext-train / maxtext-decode / maxtext-train-compile commands work from any directory.
set -euo pipefail
cd "$(dirname "$0")"
for arg in "$@"; do  # KEY=VALUE arguments, as MaxText's setup.sh takes them
  case "$arg" in
    DEVICE=*|TEST=*|PYTHON=*) export "${arg?}" ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (takes DEVICE=cpu|gpu|tpu, TEST=1, PYTHON=...)" >&2; exit 2 ;;
  esac
done
DEVICE="${DEVICE:-cpu}"
PYTHON="${PYTHON:-python3}"
say() { echo "setup.sh: $*"; }
case "$DEVICE" in
  cpu|gpu|tpu) ;;
  *) echo "setup.sh: DEVICE must be cpu, gpu or tpu (got '$DEVICE')" >&2; exit 2 ;;
esac

if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] && \
   [ -f "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/EXTERNALLY-MANAGED" ]; then
  [ -d .venv ] || "$PYTHON" -m venv .venv
  PYTHON="$PWD/.venv/bin/python"
  say "the system Python is externally managed; installing into .venv. Afterwards run: source .venv/bin/activate"
fi
say "installing for DEVICE=$DEVICE into $("$PYTHON" -c 'import sys; print(sys.prefix)')"

say "upgrading pip"
"$PYTHON" -m pip install --quiet --upgrade pip
say "runtime dependencies (requirements.txt: jax, flax, optax, orbax, data and tokenizer libraries, tensorboard)"
"$PYTHON" -m pip install --quiet -r requirements.txt
case "$DEVICE" in
  cpu) ;;
  gpu) say "jax[cuda12] (CUDA 12 wheels: cuDNN, NCCL)"
       "$PYTHON" -m pip install --quiet "jax[cuda12]==$(grep '^jax==' requirements.txt | cut -d= -f3)" ;;
  tpu) say "libtpu (requirements-tpu.txt)"
       "$PYTHON" -m pip install --quiet -r requirements-tpu.txt ;;
esac
if [ "${TEST:-0}" = "1" ]; then
  say "test and lint tools (requirements-test.txt: pytest, ruff, torch and transformers for parity tests)"
  "$PYTHON" -m pip install --quiet -r requirements-test.txt
  say "libtpu: tests compile for TPU topologies on the CPU"
  "$PYTHON" -m pip install --quiet -r requirements-tpu.txt
  if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null; then
    say "openssh-server: the multi-host runner's tests use sshd on 127.0.0.1 as remote hosts"
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server openssh-client
  fi
fi
say "this repository, editable (pip install -e .)"
"$PYTHON" -m pip install --quiet --no-deps -e .
"$PYTHON" -c "import jax; print('setup.sh: done: jax', jax.__version__, 'on', jax.default_backend(), jax.devices())"
