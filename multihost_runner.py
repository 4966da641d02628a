"""Run one command on every host of machines you already have: quick multi-host experiments.

TPU VMs (through gcloud; every slice whose name starts with --TPU_PREFIX):
  python3 multihost_runner.py --TPU_PREFIX=my-v5e --ZONE=us-west4-a \
    --COMMAND="DEVICE=tpu bash setup.sh && python3 MaxText/train.py MaxText/configs/base.yml run_name=x"
Any machines reachable over ssh (GPU or CPU hosts; the first host is the coordinator):
  python3 multihost_runner.py --HOSTS=user@h1,user@h2:2222 --COMMAND="python3 MaxText/train.py ..."

It copies --SCRIPT_DIR (default: here) to every host (unless --USE_EXISTING_FOLDER), runs --COMMAND
there from the copy with JAX_COORDINATOR_ADDRESS, JAX_COORDINATOR_PORT, NNODES and NODE_RANK (TPU:
MEGASCALE_* for multi-slice) in its environment, streams every host's output prefixed with its rank
and saves it to <LOG_DIR>/host<rank>.log. When one host fails, the others are stopped; the exit
status is the first failure's (0 when all succeed). With --IMAGE the command runs in that container
image on every host (`docker run`, the Dockerfile's images; docs/multihost.md, "Container images").
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import NamedTuple

from MaxText import cli

MEGASCALE_PORT = 8080  # the port TPU multi-slice (DCN) coordination listens on


class Host(NamedTuple):
  rank: int
  name: str  # for logs
  ssh: list[str]  # argv prefix: append one remote shell command
  copy: list[str]  # argv that reads a .tar.gz on stdin and unpacks it into the remote folder; [] to skip
  env: dict[str, str]  # rank, coordinator and slice variables for this host


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = cli.parser("python3 multihost_runner.py", __doc__, "docs/multihost.md")
  p.add_argument("--COMMAND", required=True, help="shell command to run on every host, from the copied folder")
  p.add_argument("--HOSTS", default="", help="comma-separated [user@]host[:port] reachable over ssh")
  p.add_argument("--TPU_PREFIX", default="", help="TPU VM name (prefix): every slice whose name starts with it")
  p.add_argument("--PROJECT", default="", help="gcloud project (TPU only; default: gcloud's)")
  p.add_argument("--ZONE", default="", help="gcloud zone (TPU only; default: gcloud's)")
  p.add_argument("--SCRIPT_DIR", default=os.getcwd(), help="local folder to copy to every host")
  p.add_argument("--RUN_NAME", default=datetime.datetime.now().strftime("run_%Y%m%d_%H%M%S"))
  p.add_argument("--REMOTE_DIR", default="", help="folder on the hosts ({rank} expands); default: ~/<RUN_NAME>")
  p.add_argument("--LOG_DIR", default="", help="where host<rank>.log go; default: /tmp/<RUN_NAME>")
  p.add_argument("--INTERNAL_IP", type=_bool, default=False, help="TPU: ssh over the internal IP (from a VM)")
  p.add_argument("--USE_EXISTING_FOLDER", type=_bool, default=False, help="skip the copy; the folder is there")
  p.add_argument("--SSH_ARGS", default="", help="extra ssh options for --HOSTS, e.g. '-i key -o ...'")
  p.add_argument("--COORDINATOR_PORT", type=int, default=8476, help="JAX_COORDINATOR_PORT on every host")
  p.add_argument("--IMAGE", default="", help="run the command in this container image (docker run) on every host")
  p.add_argument(
    "--DOCKER_ARGS", default="--privileged",
    help="more `docker run` flags with --IMAGE: --privileged (the default) lets TPU VMs' chips in; GPUs: '--gpus all'",
  )  # fmt: skip
  args = p.parse_args(argv)
  if bool(args.HOSTS) == bool(args.TPU_PREFIX):
    p.error("give exactly one of --HOSTS and --TPU_PREFIX")
  args.REMOTE_DIR = args.REMOTE_DIR or args.RUN_NAME
  args.LOG_DIR = args.LOG_DIR or os.path.join(tempfile.gettempdir(), args.RUN_NAME)
  return args


def _bool(value: str) -> bool:
  if value.lower() not in ("true", "false", "1", "0"):
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
  return value.lower() in ("true", "1")


def ssh_hosts(args: argparse.Namespace) -> list[Host]:
  """--HOSTS entries -> Hosts; the first one's address is the JAX coordinator."""
  targets = [t.strip() for t in args.HOSTS.split(",") if t.strip()]
  coordinator = targets[0].split("@")[-1].rsplit(":", 1)[0]
  hosts = []
  for rank, target in enumerate(targets):
    address, _, port = target.partition(":")
    ssh = ["ssh", "-o", "BatchMode=yes", *shlex.split(args.SSH_ARGS), *(["-p", port] if port else []), address]
    folder = args.REMOTE_DIR.format(rank=rank)
    copy = [] if args.USE_EXISTING_FOLDER else [*ssh, f"mkdir -p {folder} && tar -xzf - -C {folder}"]
    env = {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_COORDINATOR_PORT": str(args.COORDINATOR_PORT)}
    env.update(NNODES=str(len(targets)), NODE_RANK=str(rank))
    hosts.append(Host(rank, target, ssh, copy, env))
  return hosts


def _gcloud(args: argparse.Namespace, *words: str) -> list[str]:
  flags = [f"--project={args.PROJECT}"] * bool(args.PROJECT) + [f"--zone={args.ZONE}"] * bool(args.ZONE)
  return ["gcloud", "compute", "tpus", "tpu-vm", *words, *flags]


def _gcloud_output(args: argparse.Namespace, *words: str) -> str:
  """gcloud's stdout; when gcloud fails (no credentials, no such project or zone, API disabled) or is not
  installed, exit with one line carrying gcloud's own message instead of a traceback."""
  command = _gcloud(args, *words)
  try:
    result = subprocess.run(command, capture_output=True, text=True)
  except FileNotFoundError:
    sys.exit("gcloud is not installed (or not on PATH): install the Google Cloud CLI, or pass --HOSTS")
  if result.returncode != 0:
    message = " ".join((result.stderr or result.stdout).split()) or "no message"
    sys.exit(f"{' '.join(command[:5])} failed (exit {result.returncode}): {message}")
  return result.stdout


def tpu_hosts(args: argparse.Namespace) -> list[Host]:
  """Every worker of every slice named <TPU_PREFIX>* ; slices talk over DCN through MEGASCALE_*."""
  listing = _gcloud_output(
    args, "list", f"--filter=name~^{args.TPU_PREFIX}", "--format=value(name,networkEndpoints.len())"
  ).split()
  slices = [(listing[i], int(listing[i + 1])) for i in range(0, len(listing), 2)]
  if not slices:
    sys.exit(f"no TPU VM named {args.TPU_PREFIX}* in this project/zone")
  first_ip = _gcloud_output(args, "describe", slices[0][0], "--format=value(networkEndpoints[0].ipAddress)").strip()
  hosts, internal = [], ["--internal-ip"] if args.INTERNAL_IP else []
  for slice_id, (name, workers) in enumerate(slices):
    for worker in range(workers):
      ssh = [*_gcloud(args, "ssh", name, f"--worker={worker}", *internal), "--command"]
      folder = args.REMOTE_DIR.format(rank=len(hosts))
      copy = [] if args.USE_EXISTING_FOLDER else [*ssh, f"mkdir -p {folder} && tar -xzf - -C {folder}"]
      env = {"MEGASCALE_NUM_SLICES": str(len(slices)), "MEGASCALE_SLICE_ID": str(slice_id)}
      env.update(MEGASCALE_COORDINATOR_ADDRESS=f"{first_ip}:{MEGASCALE_PORT}", MEGASCALE_PORT=str(MEGASCALE_PORT))
      hosts.append(Host(len(hosts), f"{name}/worker{worker}", ssh, copy, env))
  return hosts


def remote_command(host: Host, args: argparse.Namespace) -> str:
  """cd + environment + the command in its own process group, killed when our ssh's stdin closes.

  Closing the connection alone does not stop a remote process, so a watcher waits for EOF on stdin
  (which we close to stop the host) and then kills the command's whole process group.
  """
  exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in host.env.items())
  folder = args.REMOTE_DIR.format(rank=host.rank)
  return (
    f"cd {folder} || exit 97; export {exports}; exec 3<&0; "
    f"setsid bash -c {shlex.quote(in_image(host, args))} </dev/null 3<&- & c=$!; "
    '(while read -r _ <&3; do :; done; kill -TERM -- -"$c") >/dev/null 2>&1 & w=$!; exec 3<&-; '
    'wait "$c"; rc=$?; kill "$w" 2>/dev/null; exit "$rc"'
  )


def in_image(host: Host, args: argparse.Namespace) -> str:
  """--COMMAND, or with --IMAGE a `docker run` of it in that image: the host's network and shared memory,
  --DOCKER_ARGS (devices: --privileged for TPU chips, '--gpus all'), this host's variables, the copied folder mounted
  over the image's /maxtext (the code you copied runs on the image's pinned packages). The container is
  named after the run and rank, and removed when it ends; docker passes SIGTERM on to it."""
  if not args.IMAGE:
    return args.COMMAND
  env = " ".join(f"-e {k}" for k in host.env)
  name = f"{args.RUN_NAME}-{host.rank}"
  return (
    f'docker run --rm --name {shlex.quote(name)} --net=host --ipc=host {env} -v "$PWD":/maxtext '
    f"-w /maxtext {args.DOCKER_ARGS} --entrypoint bash {shlex.quote(args.IMAGE)} -c {shlex.quote(args.COMMAND)}"
  )


def copy_folder(hosts: list[Host], script_dir: str) -> None:
  """One .tar.gz of script_dir, unpacked on every host in parallel; exits if any copy fails."""
  with tempfile.NamedTemporaryFile(suffix=".tar.gz") as archive:
    with tarfile.open(archive.name, "w:gz") as tar:
      tar.add(script_dir, arcname=".", filter=lambda info: None if os.path.basename(info.name) == ".git" else info)
    procs = []
    for host in hosts:
      with open(archive.name, "rb") as stdin:
        procs.append(
          (host, subprocess.Popen(host.copy, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        )
    failed = [(h, p.communicate()[1]) for h, p in procs if p.wait() != 0]
  if failed:
    sys.exit("copy failed on " + "; ".join(f"host {h.rank} ({h.name}): {err.strip()}" for h, err in failed))


def _stream(host: Host, proc: subprocess.Popen, log_path: str) -> None:
  with open(log_path, "w") as log:
    for line in proc.stdout:
      log.write(line)
      log.flush()
      sys.stdout.write(f"[host {host.rank}] {line}")
      sys.stdout.flush()


def run_all(hosts: list[Host], args: argparse.Namespace) -> int:
  """Start the command on every host; stop them all at the first failure; the first failure's status."""
  os.makedirs(args.LOG_DIR, exist_ok=True)
  running = []
  for host in hosts:
    proc = subprocess.Popen(
      [*host.ssh, remote_command(host, args)],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    thread = threading.Thread(target=_stream, args=(host, proc, os.path.join(args.LOG_DIR, f"host{host.rank}.log")))
    thread.start()
    running.append((host, proc, thread))
  status = 0
  while [p.poll() for _, p, _ in running].count(None) and status == 0:  # poll every host, every time
    failed = [(h, p.returncode) for h, p, _ in running if p.returncode not in (None, 0)]
    if failed:
      status = failed[0][1]
      print(f"multihost_runner: host {failed[0][0].rank} ({failed[0][0].name}) exited {status}; stopping the others")
    time.sleep(0.2)
  for _, proc, _ in running:
    _stop(proc)
  for _, _, thread in running:
    thread.join()
  status = status or next((p.returncode for _, p, _ in running if p.returncode), 0)
  print(f"multihost_runner: {'all hosts succeeded' if status == 0 else f'failed ({status})'}; logs in {args.LOG_DIR}")
  return status


def _stop(proc: subprocess.Popen) -> None:
  """EOF on stdin makes the remote watcher kill the command; then the local ssh is ended if need be."""
  try:
    proc.stdin.close()
  except OSError:
    pass
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    proc.terminate()
    proc.wait()


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first). Exits with the first failing host's status."""
  args = parse_args(argv[1:])
  hosts = ssh_hosts(args) if args.HOSTS else tpu_hosts(args)
  if not args.USE_EXISTING_FOLDER:
    copy_folder(hosts, args.SCRIPT_DIR)
  status = run_all(hosts, args)
  if status:
    sys.exit(status)


if __name__ == "__main__":
  main(sys.argv)
