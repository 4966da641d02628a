"""multihost_runner.py --HOSTS against two ssh "hosts": an sshd on 127.0.0.1 started here."""

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from MaxText.tests.conftest import ROOT

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
  """An sshd on 127.0.0.1 accepting one generated key; yields the ssh options that reach it."""
  if SSHD is None or shutil.which("ssh") is None:
    if os.environ.get("CI"):
      pytest.fail("sshd is not installed: TEST=1 bash setup.sh installs openssh-server")
    pytest.skip("openssh-server is not installed (TEST=1 bash setup.sh installs it)")
  d = tmp_path_factory.mktemp("sshd")
  for key in ("host_key", "client_key"):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
  shutil.copy(d / "client_key.pub", d / "authorized_keys")
  os.makedirs("/run/sshd", exist_ok=True) if os.geteuid() == 0 else None
  port = _free_port()
  (d / "sshd_config").write_text(
    f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
    f"PidFile {d / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\nPermitRootLogin yes\n"
    f"SetEnv PATH={os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin\n"
  )
  proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE, text=True)
  options = f"-i {d / 'client_key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
  target = f"{getpass.getuser()}@127.0.0.1:{port}"
  deadline = time.time() + 20
  while subprocess.run(["ssh", *options.split(), "-p", str(port), target.split(":")[0], "true"]).returncode:
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      pytest.fail(f"sshd did not start: {proc.stderr.read() if proc.poll() is not None else 'timeout'}")
    time.sleep(0.2)
  yield target, options
  proc.terminate()
  proc.wait()


def runner(tmp_path, sshd, command):
  target, options = sshd
  args = [sys.executable, "multihost_runner.py", f"--HOSTS={target},{target}", f"--COMMAND={command}"]
  args += [f"--SSH_ARGS={options}", f"--REMOTE_DIR={tmp_path}/remote/host{{rank}}", f"--LOG_DIR={tmp_path}/logs"]
  args += ["--RUN_NAME=t", f"--SCRIPT_DIR={tmp_path}/code"]
  return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture
def code(tmp_path):
  os.makedirs(tmp_path / "code")
  (tmp_path / "code" / "job.sh").write_text('echo "rank=$NODE_RANK of $NNODES at $JAX_COORDINATOR_ADDRESS"\n')
  return tmp_path / "code"


def test_runs_on_every_host_with_rank_and_saves_logs(tmp_path, sshd, code):
  result = runner(tmp_path, sshd, "bash job.sh && pwd")
  assert result.returncode == 0, result.stdout + result.stderr
  for rank in (0, 1):
    log = (tmp_path / "logs" / f"host{rank}.log").read_text()
    assert f"rank={rank} of 2 at 127.0.0.1" in log
    assert f"remote/host{rank}" in log  # each host ran from its own copy
    assert f"[host {rank}] rank={rank} of 2" in result.stdout


def test_one_failing_host_fails_the_run_and_stops_the_other(tmp_path, sshd, code):
  start = time.time()
  result = runner(tmp_path, sshd, 'if [ "$NODE_RANK" = 1 ]; then exit 3; fi; sleep 60; echo survived')
  assert result.returncode == 3, result.stdout + result.stderr
  assert "host 1" in result.stdout and "stopping the others" in result.stdout
  assert time.time() - start < 40
  time.sleep(1)
  assert "survived" not in (tmp_path / "logs" / "host0.log").read_text()
  ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
  assert "sleep 60; echo survived" not in ps  # the remote command was killed, not just the ssh client


def test_image_runs_the_command_through_docker_with_the_host_variables(tmp_path, monkeypatch):
  """--IMAGE: each host's command becomes one `docker run` of the image with that host's variables passed
  in (-e) and the copied folder mounted; a stand-in `docker` on PATH records its arguments and runs the
  command. The hosts are local bash shells in place of ssh."""
  import multihost_runner

  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "docker").write_text(
    f"#!{sys.executable}\n"
    "import json, os, subprocess, sys\n"
    "argv = sys.argv[1:]\n"
    "passed = {argv[i + 1]: os.environ[argv[i + 1]] for i, a in enumerate(argv) if a == '-e'}\n"
    "print('docker ' + json.dumps({'argv': argv, 'env': passed}), flush=True)\n"
    "sys.exit(subprocess.run(['bash', '-c', argv[-1]], env={**os.environ, **passed}).returncode)\n"
  )
  (bin_dir / "docker").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
  args = multihost_runner.parse_args(
    ["--HOSTS=a,b", "--COMMAND=echo rank=$NODE_RANK of $NNODES", "--IMAGE=maxtext:cpu", "--RUN_NAME=img",
     "--DOCKER_ARGS=--gpus all", f"--LOG_DIR={tmp_path}/logs", f"--REMOTE_DIR={tmp_path}/host{{rank}}"]
  )  # fmt: skip
  assert multihost_runner.parse_args(["--HOSTS=a", "--COMMAND=x"]).DOCKER_ARGS == "--privileged"  # TPU chips
  hosts = [h._replace(ssh=["bash", "-c"]) for h in multihost_runner.ssh_hosts(args)]
  for host in hosts:
    (tmp_path / f"host{host.rank}").mkdir()
  assert multihost_runner.run_all(hosts, args) == 0
  for rank in (0, 1):
    lines = (tmp_path / "logs" / f"host{rank}.log").read_text().splitlines()
    call = json.loads(lines[0].removeprefix("docker "))
    assert call["env"] == {"JAX_COORDINATOR_ADDRESS": "a", "JAX_COORDINATOR_PORT": "8476", "NNODES": "2",
                           "NODE_RANK": str(rank)}  # fmt: skip
    argv = call["argv"]
    assert argv[:4] == ["run", "--rm", "--name", f"img-{rank}"] and "--net=host" in argv and "--gpus" in argv
    assert argv[argv.index("-v") + 1] == f"{tmp_path}/host{rank}:/maxtext"
    assert argv[-4:] == ["bash", "maxtext:cpu", "-c", "echo rank=$NODE_RANK of $NNODES"]
    assert lines[1] == f"rank={rank} of 2"


def tpu_runner(tmp_path, gcloud_script):
  """multihost_runner.py --TPU_PREFIX with a fake gcloud (a shell script) first on PATH."""
  bin_dir = tmp_path / "bin"
  os.makedirs(bin_dir, exist_ok=True)
  if gcloud_script is not None:
    (bin_dir / "gcloud").write_text(f"#!/bin/sh\n{gcloud_script}\n")
    os.chmod(bin_dir / "gcloud", 0o755)
  env = {**os.environ, "PATH": str(bin_dir)}  # only the fake gcloud (the script names /bin/sh itself)
  args = [sys.executable, "multihost_runner.py", "--TPU_PREFIX=mytpu", "--COMMAND=true", "--ZONE=us-east5-b"]
  return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_failing_gcloud_listing_exits_with_gclouds_message_in_one_line(tmp_path):
  message = (
    "ERROR: (gcloud.compute.tpus.tpu-vm.list) You do not currently have an active account selected.\\n"
    "  Please run:\\n    $ gcloud auth login"
  )
  result = tpu_runner(tmp_path, f'printf "{message}\\n" >&2; exit 1')
  assert result.returncode == 1, result.stderr
  assert "Traceback" not in result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  head = "gcloud compute tpus tpu-vm list failed (exit 1): ERROR: (gcloud.compute.tpus.tpu-vm.list) You do not"
  assert lines[0].startswith(head)
  assert lines[0].endswith("active account selected. Please run: $ gcloud auth login")


def test_missing_gcloud_exits_with_one_line(tmp_path):
  result = tpu_runner(tmp_path, None)
  assert result.returncode == 1 and "Traceback" not in result.stderr
  assert result.stderr.strip().startswith("gcloud is not installed (or not on PATH)")
