"""A one-node Slurm cluster on 127.0.0.1 for the tests (slurm_test.py) and for trying the Slurm launcher.

Debian's `slurm-wlm` and `munge` (TEST=1 bash setup.sh installs them when it runs as root): munged with a key
of its own on a private socket, slurmctld and slurmd in the foreground as root, a minimal slurm.conf without
cgroups (proctrack/linuxproc, task/none), state and logs under one folder, free ports. Nothing is written
outside that folder; the daemons are ended by their process ids.

  python3 MaxText/tests/slurm_cluster.py /tmp/slurm   # starts one and prints the SLURM_CONF to export;
                                                      # Ctrl-C cancels its jobs and stops it
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
CPUS = 2  # the node's CPUs as Slurm counts them; OverSubscribe lets more tasks than that share them
REQUEUE_DELAY_S = 5  # how long a requeued job waits before it may start again (Slurm's default: 120 s)


def missing() -> str | None:
  """Why no cluster can be started here, or None."""
  absent = [name for name in DAEMONS + CLIENTS if not shutil.which(name, path=os.environ["PATH"] + ":/usr/sbin")]
  if absent:
    return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge; TEST=1 bash setup.sh as root does)"
  if os.geteuid() != 0:
    return "the test cluster runs slurmd as root (it starts jobs as their users)"
  return None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def slurm_conf(root: str) -> str:
  """A minimal slurm.conf: node `localhost` with CPUS CPUs, one default partition, no accounting, no cgroups."""
  return f"""ClusterName=maxtext-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock,cred_expire={REQUEUE_DELAY_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class Cluster:
  """Start with `with Cluster(root) as cluster:`; `cluster.env` is os.environ with SLURM_CONF set."""

  def __init__(self, root: str):
    self.root = os.path.abspath(root)
    self.conf = os.path.join(self.root, "slurm.conf")
    self.env = {**os.environ, "SLURM_CONF": self.conf}
    self.procs: list[subprocess.Popen] = []

  def __enter__(self) -> Cluster:
    try:
      self.start()
    except BaseException:
      self.stop()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

  def _daemon(self, name: str, *args: str) -> None:
    log = open(os.path.join(self.root, "log", f"{name}.out"), "w")
    path = shutil.which(name, path=os.environ["PATH"] + ":/usr/sbin")
    proc = subprocess.Popen([path, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT)
    self.procs.append(proc)

  def start(self, timeout: float = 60) -> None:
    for sub in ("munge", "state", "spool", "log"):
      os.makedirs(os.path.join(self.root, sub), exist_ok=True)
    os.chmod(os.path.join(self.root, "munge"), 0o755)  # munged wants its socket's folder searchable by all
    key = os.path.join(self.root, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
      f.write(os.urandom(1024))
    with open(self.conf, "w") as f:
      f.write(slurm_conf(self.root))
    m = self.root
    self._daemon(
      "munged", "-F", "--force", f"--socket={m}/munge/munge.sock", f"--key-file={key}",
      f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed", f"--log-file={m}/log/munged.log",
    )  # fmt: skip
    self._wait(lambda: os.path.exists(f"{m}/munge/munge.sock"), timeout, "munged")
    self._daemon("slurmctld", "-D", "-i")
    self._wait(lambda: self.run("scontrol", "ping").returncode == 0, timeout, "slurmctld")
    self._daemon("slurmd", "-D", "-N", "localhost")
    self._wait(lambda: "idle" in self.run("sinfo", "-h", "-o", "%T").stdout, timeout, "slurmd (node idle)")

  def _wait(self, ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
      dead = [p.args[0] for p in self.procs if p.poll() is not None]
      if dead or time.monotonic() > deadline:
        raise RuntimeError(f"{what} did not start ({', '.join(dead) or 'timeout'}); see {self.root}/log/")
      time.sleep(0.2)

  def run(self, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)

  def stop(self, timeout: float = 60) -> None:
    """Cancel every job (their processes too), then end the daemons, newest first."""
    if len(self.procs) == len(DAEMONS) and all(p.poll() is None for p in self.procs):
      try:
        self.run("scancel", "--full", "--signal=KILL", "--user=root")
        self.run("scancel", "--user=root")
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
          time.sleep(0.5)
      except subprocess.TimeoutExpired:  # slurmctld stopped answering: end the daemons anyway
        pass
    for proc in reversed(self.procs):
      if proc.poll() is None:
        proc.terminate()
        try:
          proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
    self.procs = []


def main(argv: list[str]) -> None:
  """argv: [program, folder]: run a cluster in that folder until SIGINT/SIGTERM."""
  if len(argv) != 2:
    sys.exit("usage: python3 MaxText/tests/slurm_cluster.py FOLDER (as root)")
  if reason := missing():
    sys.exit(f"slurm_cluster: cannot start Slurm here: {reason}")
  with Cluster(argv[1]) as cluster:
    print(f"Slurm is up (node localhost, {CPUS} CPUs). In another shell: export SLURM_CONF={cluster.conf}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
      signal.pause()
    except KeyboardInterrupt:
      pass
    print("Stopping Slurm.", flush=True)


if __name__ == "__main__":
  main(sys.argv)
