"""Multi-process start-up: `jax.distributed.initialize` chosen by `hardware=` and the environment.

Every process of a multi-host job must call `initialize(config)` before anything touches a JAX
device. Where the processes come from decides how they find each other:

- TPU VMs (`hardware=tpu`, or `auto` on a machine with a TPU): libtpu knows the slice; JAX detects
  the workers itself (the GCE metadata server; MEGASCALE_* variables for multi-slice).
- Explicit (GPU clusters such as Vertex AI A3 Mega, end_to_end/gpu/, multihost_runner.py, CPU tests):
  JAX_COORDINATOR_ADDRESS (host or host:port), JAX_COORDINATOR_PORT, NNODES (processes), NODE_RANK
  (this process), GPUS_PER_NODE (local GPUs; all when unset).
- Slurm (a task of an `srun` step of more than one task): SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)
  processes, this one SLURM_PROCID, the coordinator on the first node of SLURM_STEP_NODELIST at
  JAX_COORDINATOR_PORT, or a port derived from SLURM_JOB_ID as JAX's own Slurm detection picks it. With
  several tasks per node on GPUs, each task takes the GPU numbered SLURM_LOCALID (one process per GPU)
  unless Slurm already left it only one (CUDA_VISIBLE_DEVICES).
- Anything else: one process, nothing to initialise.

CPU processes exchange collectives through gloo, so `hardware=cpu` multi-process runs work on one
machine over 127.0.0.1 (the multi-host tests).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax

from MaxText import preemption
from MaxText.config import Config
from MaxText.errors import DistributedInitError

DEFAULT_PORT = 8476  # JAX's usual coordinator port when JAX_COORDINATOR_PORT is not set
JOB_SIZE_KEY = "maxtext/job_size"  # key-value store directory: each process's number of processes, by rank
ABORT_MARGIN_S = 5  # JAX's own initialization deadline is this much later than ours, so ours fires first


class Plan(NamedTuple):
  how: str  # "tpu" | "env" | "slurm"
  kwargs: dict[str, Any]  # for jax.distributed.initialize
  describe: str  # for error messages: who we are and whom we wait for


def on_tpu_vm() -> bool:
  """A TPU VM: libtpu is installed and the TPU chips are visible as device files."""
  has_chips = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
  return bool(has_chips) and importlib.util.find_spec("libtpu") is not None


def _int(environ: Mapping[str, str], key: str) -> int:
  try:
    return int(environ[key])
  except ValueError:
    raise DistributedInitError(f"{key}={environ[key]!r} must be an integer") from None


def _env_plan(config: Config, environ: Mapping[str, str]) -> Plan:
  missing = [k for k in ("NNODES", "NODE_RANK") if k not in environ]
  if missing:
    raise DistributedInitError(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} not; set both")
  address, nodes, rank = environ["JAX_COORDINATOR_ADDRESS"], _int(environ, "NNODES"), _int(environ, "NODE_RANK")
  if not 0 <= rank < nodes:
    raise DistributedInitError(f"NODE_RANK={rank} must be in [0, NNODES={nodes})")
  if ":" not in address:
    address = f"{address}:{environ.get('JAX_COORDINATOR_PORT', DEFAULT_PORT)}"
  kwargs = {"coordinator_address": address, "num_processes": nodes, "process_id": rank}
  if "GPUS_PER_NODE" in environ and config.hardware != "cpu":
    kwargs["local_device_ids"] = list(range(_int(environ, "GPUS_PER_NODE")))
  return Plan("env", kwargs, f"process {rank} of {nodes} with coordinator {address}")


def first_host(nodelist: str) -> str:
  """The first host name of a Slurm node list: 'gpu-[003-010,012],login1' -> 'gpu-003'.

  Slurm's compressed form is comma-separated names, each a prefix and optionally a bracketed list of
  numbers or ranges (zero padding kept) and a suffix; the first host is the prefix, the first number of the
  first bracket and the rest of that name (`scontrol show hostnames` would say the same).
  """
  match = re.match(r"([^,\[]*)(?:\[([^\]]*)\]([^,]*))?", nodelist.strip())
  prefix, numbers, suffix = match.group(1), match.group(2), match.group(3) or ""
  if numbers is None:
    first = prefix
  else:
    first = prefix + re.split(r"[,-]", numbers, maxsplit=1)[0] + (first_host(suffix) if suffix else "")
  if not first:
    raise DistributedInitError(f"cannot read the first host of the Slurm node list {nodelist!r}")
  return first


def slurm_port(environ: Mapping[str, str]) -> str:
  """JAX_COORDINATOR_PORT, else one from the job id in [61440, 65535] (JAX's SlurmCluster rule), so two jobs
  sharing a node use different ports and every task of one job computes the same one."""
  if "JAX_COORDINATOR_PORT" in environ:
    return environ["JAX_COORDINATOR_PORT"]
  return str(_int(environ, "SLURM_JOB_ID") % 2**12 + 65536 - 2**12)


def _slurm_plan(config: Config, environ: Mapping[str, str], tasks: int) -> Plan:
  if "SLURM_PROCID" not in environ:
    raise DistributedInitError(f"a Slurm job step of {tasks} tasks but SLURM_PROCID is not set")
  rank = _int(environ, "SLURM_PROCID")
  address = f"{first_host(environ['SLURM_STEP_NODELIST'])}:{slurm_port(environ)}"
  # "deactivate": JAX's own Slurm detection would otherwise fill in local_device_ids=[SLURM_LOCALID] whenever
  # they are left unset here, leaving a one-task-per-node job one GPU per node.
  kwargs: dict[str, Any] = {"coordinator_address": address, "num_processes": tasks, "process_id": rank}
  kwargs["cluster_detection_method"] = "deactivate"
  nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
  several_per_node = nodes is not None and nodes.isdigit() and tasks > int(nodes)
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  one_gpu_left = visible is not None and "," not in visible
  if config.hardware != "cpu" and several_per_node and not one_gpu_left and "SLURM_LOCALID" in environ:
    kwargs["local_device_ids"] = [_int(environ, "SLURM_LOCALID")]
  return Plan("slurm", kwargs, f"Slurm task {rank} of {tasks} with coordinator {address}")


def plan(config: Config, environ: Mapping[str, str] | None = None) -> Plan | None:
  """How this process joins the job, or None for a single-process run."""
  environ = os.environ if environ is None else environ
  if environ.get("JAX_COORDINATOR_ADDRESS"):
    return _env_plan(config, environ)
  # A task of an srun step (only srun sets SLURM_STEP_NODELIST): the batch script itself is no task.
  tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
  if environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_NODELIST") and tasks.isdigit() and int(tasks) > 1:
    return _slurm_plan(config, environ, int(tasks))
  if config.hardware == "tpu" or (config.hardware == "auto" and on_tpu_vm()):
    return Plan("tpu", {}, "a TPU VM worker (coordinator from the TPU metadata)")
  return None


def initialize(config: Config, environ: Mapping[str, str] | None = None) -> None:
  """Join the multi-process job described by the environment (see the module docstring); no-op alone."""
  p = plan(config, environ)
  if p is None:
    return
  # CPU devices need a collectives backend across processes; it changes nothing for GPU/TPU devices.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service catches SIGTERM in C++ and only logs it unless asked every step; the train
  # loop agrees on a stop step itself (preemption.Watch), for SIGINT and SIGHUP too.
  jax.config.update("jax_enable_preemption_service", False)
  # A dead process: JAX's service would end every other process with a C++ abort (status 134) once the dead
  # one misses its heartbeats; recoverable, it only marks it dead, and preemption.watch_peers exits 76.
  jax.config.update("jax_enable_recoverability", True)
  timeout = config.jax_distributed_initialization_timeout
  if p.how != "tpu" and p.kwargs["process_id"] != 0:
    # JAX aborts the whole process (no exception) when it cannot register; check the address first.
    wait_for_coordinator(p.kwargs["coordinator_address"], timeout, p.describe)
  elif p.how != "tpu":
    print(f"jax.distributed: {p.describe}; waiting up to {timeout} s for the others", flush=True)
  timeouts = {
    "heartbeat_timeout_seconds": config.jax_distributed_heartbeat_timeout,  # a silent process counts as lost
    # JAX's exit barrier waits no longer (recoverable, it does not wait: preemption._PeerWatch.leave does)
    "shutdown_timeout_seconds": config.jax_distributed_heartbeat_timeout,
    # JAX aborts the process with a C++ stack when its own deadline passes; ours (below) comes first.
    "initialization_timeout": int(timeout) + ABORT_MARGIN_S,
  }
  try:
    with _deadline(timeout, p.describe):
      jax.distributed.initialize(**p.kwargs, **timeouts)
      check_job_size(p, timeout)
  except DistributedInitError:
    raise
  except Exception as e:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED, UNAVAILABLE, ...)
    raise DistributedInitError(
      f"jax.distributed could not start as {p.describe} within {timeout} s: {e}. Check that process 0 is "
      "running and reachable at that address (firewall, port), that every process has the same NNODES, and "
      "raise jax_distributed_initialization_timeout for slow starts."
    ) from e
  checkpoint_dir = config.checkpoint_dir if config.enable_checkpointing else None
  preemption.watch_peers(checkpoint_dir, config.jax_distributed_heartbeat_timeout)


def check_job_size(p: Plan, timeout: float) -> None:
  """Every process publishes the number of processes it was started with; DistributedInitError (on every
  process) naming them when they differ.

  JAX's coordinator takes the job size from process 0 and admits any process whose rank fits in it, so
  processes started with NNODES=2 and NNODES=3 would otherwise run as a 2-process job without a word.
  """
  from jax._src import distributed as jax_distributed  # the client; jax.distributed does not export it

  state = jax_distributed.global_state
  if state.client is None:  # initialize stubbed out (tests)
    return
  client, deadline_ms = state.client, int(timeout * 1000)
  client.key_value_set(f"{JOB_SIZE_KEY}/{state.process_id}", str(state.num_processes))
  client.wait_at_barrier("maxtext_job_size_published", deadline_ms)
  sizes = {int(k.rsplit("/", 1)[1]): int(v) for k, v in client.key_value_dir_get(f"{JOB_SIZE_KEY}/")}
  # Nobody leaves (process 0 would take the coordinator with it) before every process has read the sizes.
  client.wait_at_barrier("maxtext_job_size_read", deadline_ms)
  if len(set(sizes.values())) > 1:
    if state.process_id == 0:  # the coordinator leaves last: the others still need it to disconnect
      preemption.wait_for_the_others_to_leave(client, state.num_processes, min(timeout / 2, 10.0))
    key = "NNODES" if p.how == "env" else "the process count"
    seen = ", ".join(f"process {rank}: {size}" for rank, size in sorted(sizes.items()))
    raise DistributedInitError(
      f"the processes were started with different job sizes ({key} of {seen}); JAX would run them as a "
      f"{sizes[0]}-process job. Start every process with the same {key}."
    )


@contextlib.contextmanager
def _deadline(timeout: float, describe: str) -> Iterator[None]:
  """Exit with one line (status 1) if the block has not finished within `timeout` seconds.

  jax.distributed.initialize cannot be interrupted from Python and, when the other processes never
  register, ends the process with a C++ check failure; a watchdog thread gets the message out first.
  """
  finished = threading.Event()

  def watchdog() -> None:
    if not finished.wait(timeout):
      sys.stderr.write(
        f"Distributed initialisation failed: the other processes did not all join within {timeout:g} s "
        f"({describe}). Start every process (NNODES of them, each with its own NODE_RANK) or raise "
        "jax_distributed_initialization_timeout.\n"
      )
      sys.stderr.flush()
      os._exit(1)

  threading.Thread(target=watchdog, name="distributed-init-deadline", daemon=True).start()
  try:
    yield
  finally:
    finished.set()


def wait_for_coordinator(address: str, timeout: float, describe: str) -> None:
  """Until `timeout` seconds: connect to the coordinator's TCP port; DistributedInitError if it never answers."""
  host, port = address.rsplit(":", 1)
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=min(5.0, max(timeout, 0.1))):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise DistributedInitError(
          f"the coordinator {address} was not reachable within {timeout:g} s ({e}) for {describe}. Start "
          "process 0 (NODE_RANK=0) on that host, check JAX_COORDINATOR_ADDRESS/JAX_COORDINATOR_PORT and the "
          "firewall, or raise jax_distributed_initialization_timeout."
        ) from None
      time.sleep(0.5)
