#!/usr/bin/env bash
# Idempotent install. DEVICE=cpu (default) | gpu | tpu. TEST=1 also installs the test/lint tools.
# Installs into the active Python environment (a venv, conda, or a user-writable Python); where the
# system Python is externally managed (PEP 668) and no venv is active, it creates .venv and says so.
set -euo pipefail
cd "$(dirname "$0")"
DEVICE="${DEVICE:-cpu}"
PYTHON="${PYTHON:-python3}"

if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] && \
   [ -f "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/EXTERNALLY-MANAGED" ]; then
  [ -d .venv ] || "$PYTHON" -m venv .venv
  PYTHON="$PWD/.venv/bin/python"
  echo "setup.sh: the system Python is externally managed; installed into .venv. Run: source .venv/bin/activate"
fi

"$PYTHON" -m pip install --quiet --upgrade pip
"$PYTHON" -m pip install --quiet -r requirements.txt
case "$DEVICE" in
  cpu) ;;
  gpu) "$PYTHON" -m pip install --quiet "jax[cuda12]==$(grep '^jax==' requirements.txt | cut -d= -f3)" ;;
  tpu) "$PYTHON" -m pip install --quiet -r requirements-tpu.txt ;;
  *) echo "setup.sh: DEVICE must be cpu, gpu or tpu (got '$DEVICE')" >&2; exit 2 ;;
esac
if [ "${TEST:-0}" = "1" ]; then
  "$PYTHON" -m pip install --quiet -r requirements-test.txt
  # Tests compile for TPU topologies on the CPU (libtpu) and run sshd on 127.0.0.1 as remote hosts.
  "$PYTHON" -m pip install --quiet -r requirements-tpu.txt
  if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server openssh-client
  fi
fi
"$PYTHON" -c "import jax; print('setup.sh: jax', jax.__version__, 'on', jax.default_backend(), jax.devices())"
