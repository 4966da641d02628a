"""Tests run on 8 fake CPU devices; XLA_FLAGS must be set before jax is imported. Also the helpers that
run an entry point as several cooperating processes on 127.0.0.1 (multihost_test, decode_test)."""

import os
import socket
import subprocess

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(command, cwd, log_dir, name, processes, devices_per_process, timeout=300):
  """Run `command` as `processes` processes of one jax.distributed job (coordinator on 127.0.0.1, CPU
  devices, gloo collectives); returns [(returncode, combined output)] in rank order."""
  port = free_port()
  procs = []
  for rank in range(processes):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NNODES": str(processes), "NODE_RANK": str(rank)}
    env.update(JAX_COORDINATOR_ADDRESS="127.0.0.1", JAX_COORDINATOR_PORT=str(port))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    log = open(os.path.join(log_dir, f"{name}.{rank}.log"), "w+")
    procs.append((subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  results = []
  for proc, log in procs:
    proc.wait(timeout=timeout)
    log.seek(0)
    results.append((proc.returncode, log.read()))
    log.close()
  return results
