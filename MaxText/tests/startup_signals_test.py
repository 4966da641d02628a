"""A SIGINT or SIGTERM in the first moments of a program's start (its imports: jax, flax, orbax, before any config
is read) ends it with one line and status 128 + signal, as docs/failures.md says for a signal before training,
for `python3 MaxText/train.py` and `python3 -m MaxText.decode` alike; a program that is not MaxText's keeps its
own handling. Real processes, signalled as soon as their handlers are in place."""

import os
import signal
import subprocess
import sys
import time

import pytest

from MaxText.tests.conftest import BASE, ROOT, TINY

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/<pid>/status")


def caught(pid: int) -> set[int]:
  """The signals process `pid` has a handler for (its SigCgt mask)."""
  with open(f"/proc/{pid}/status") as f:
    mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
  return {n for n in range(1, 64) if mask >> (n - 1) & 1}


def signal_when_handled(command, signum, timeout=60):
  """Start `command`, send `signum` as soon as it handles SIGINT and SIGTERM; (status, output, whether jax was
  still loading then, seconds from the signal to the exit)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + timeout
  try:
    while not {signal.SIGINT, signal.SIGTERM} <= caught(proc.pid):
      assert proc.poll() is None and time.monotonic() < deadline, "never handled the signals"
      time.sleep(0.005)
    with open(f"/proc/{proc.pid}/maps") as f:
      importing = "jaxlib" not in f.read()  # jax's native library is not loaded yet
    proc.send_signal(signum)
    sent = time.monotonic()
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output, importing, time.monotonic() - sent
  finally:
    proc.kill()


def train_command(tmp_path):
  return [sys.executable, "-u", "MaxText/train.py", BASE, "run_name=t", f"base_output_directory={tmp_path}", *TINY]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_train_imports_exits_in_one_line(tmp_path, signum):
  rc, output, importing, took = signal_when_handled(train_command(tmp_path), signum)
  name = signal.Signals(signum).name
  assert rc == 128 + signum, output[-2000:]
  assert output == f"{name} received outside the training loop (nothing to save): exiting at once with status {rc}.\n"
  assert importing and took < 20  # before jax was loaded: nothing of the run had started
  assert not os.path.exists(tmp_path / "t")


def test_a_signal_during_decode_imports_as_a_module_exits_in_one_line(tmp_path):
  command = [sys.executable, "-u", "-m", "MaxText.decode", BASE, "run_name=t", *TINY]
  rc, output, _, _ = signal_when_handled(command, signal.SIGTERM)
  assert rc == 128 + signal.SIGTERM and output.endswith("exiting at once with status 143.\n"), output[-2000:]
  assert "Traceback" not in output


def test_other_programs_keep_their_own_handling():
  code = "import MaxText, signal, sys; sys.exit(signal.getsignal(signal.SIGINT) is not signal.default_int_handler)"
  assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0
