"""Kubernetes JobSet manifests for `multihost_job.py --PLATFORM=jobset`: TPU slices or GPU nodes on GKE.

The code and its packages come in the container image (--IMAGE; the Dockerfile at the repository root
builds one), so nothing is uploaded. One JobSet (apiVersion jobset.x-k8s.io/v1alpha2) holds:

- TPU (--DEVICE=tpu): one replicated job `slice` with --NUM_SLICES replicas; each is an Indexed Job of
  one pod per TPU host of a --TPU_TYPE slice, on nodes selected by GKE's TPU accelerator and topology
  labels, each pod asking for its host's chips (google.com/tpu).
- GPU (--DEVICE=gpu): one replicated job `node`, an Indexed Job of --NUM_NODES pods, each on a node
  with the GKE accelerator label of --MACHINE_TYPE, asking for --GPUS_PER_NODE GPUs (nvidia.com/gpu).

Every pod gets what MaxText/distributed.py reads: JAX_COORDINATOR_ADDRESS (pod 0 of job 0 through the
JobSet's headless service, `<name>-<replicated job>-0-0.<name>`), JAX_COORDINATOR_PORT, NNODES and
NODE_RANK. NODE_RANK is the pod's completion index, plus slice index x hosts per slice for TPU (an env
entry cannot add, so the container's shell computes it). With several slices, TPU pods also get
MEGASCALE_* (the DCN coordinator of multi-slice, as multihost_runner.py sets them). TPU_WORKER_ID and
TPU_WORKER_HOSTNAMES (a slice's hosts, which libtpu joins over ICI) are GKE's to set: its TPU webhook
adds them to the pods of an Indexed Job with a subdomain, which JobSet's are.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
from typing import NamedTuple

from MaxText.launchers import to_yaml

API_VERSION = "jobset.x-k8s.io/v1alpha2"
MEGASCALE_PORT = 8080  # multi-slice (DCN) coordination, as multihost_runner.py
CONTAINER = "maxtext"
GRACE_PERIOD_S = 300  # SIGTERM -> checkpoint at the next step boundary -> exit; then Kubernetes sends SIGKILL
# GKE node labels: TPU family -> cloud.google.com/gke-tpu-accelerator.
TPU_ACCELERATORS = {
  "v4": "tpu-v4-podslice",
  "v5e": "tpu-v5-lite-podslice",
  "v5p": "tpu-v5p-slice",
  "v6e": "tpu-v6e-slice",
}
# Compute Engine machine type -> cloud.google.com/gke-accelerator of its GPUs (A3 High, A3 Mega).
GPU_ACCELERATORS = {"a3-highgpu-8g": "nvidia-h100-80gb", "a3-megagpu-8g": "nvidia-h100-mega-80gb"}
XLA_RECIPE = "end_to_end/gpu/a3mega_xla_flags.sh"  # in the image (the repository is its working directory)


class TpuSlice(NamedTuple):
  """One TPU slice as GKE schedules it."""

  accelerator: str  # cloud.google.com/gke-tpu-accelerator, e.g. tpu-v5-lite-podslice
  topology: str  # cloud.google.com/gke-tpu-topology, e.g. 16x16
  hosts: int  # pods (VMs) per slice
  chips_per_host: int  # google.com/tpu of each pod


def tpu_slice(tpu_type: str) -> TpuSlice:
  """gcloud's accelerator type (v5litepod-256, v6e-16, v4-32, v5p-128; also v5e-N) as a GKE slice.

  The chip grid is accelerators.tpu_topology's (the AOT table). Hosts drive 4 chips each, except the
  single-host v5e/v6e shapes of up to 8 chips (one VM with all of them); v4/v5p sizes count cores.
  ValueError for a name that is not a TPU slice.
  """
  from MaxText import accelerators  # lazy: jax is imported only for TPU manifests

  family, _, size = tpu_type.lower().partition("-")
  family = {"v5litepod": "v5e"}.get(family, family)
  try:
    topology = accelerators.tpu_topology(f"{family}-{size}")
  except ValueError as e:
    raise ValueError(f"--TPU_TYPE={tpu_type}: {e}") from None
  grid = topology.topology_name.split(":")[1]
  chips = math.prod(int(n) for n in grid.split("x"))
  per_host = chips if family in ("v5e", "v6e") and chips <= 8 else min(chips, 4)
  return TpuSlice(TPU_ACCELERATORS[family], grid, chips // per_host, per_host)


def _field(name: str, annotation: str) -> dict:
  """An env entry read from one of the pod's annotations (set by the Job and JobSet controllers)."""
  return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}}}


def _env(pairs: dict[str, object]) -> list[dict]:
  return [{"name": k, "value": str(v)} for k, v in pairs.items()]


def tpu_env(args: argparse.Namespace, s: TpuSlice) -> list[dict]:
  """The environment of every TPU pod; $(NAME) refers to an entry above it (Kubernetes expands it)."""
  coordinator = f"{args.RUN_NAME}-slice-0-0.{args.RUN_NAME}"
  env = [
    _field("SLICE_INDEX", "jobset.sigs.k8s.io/job-index"),
    _field("JOB_COMPLETION_INDEX", "batch.kubernetes.io/job-completion-index"),
    *_env({"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_COORDINATOR_PORT": args.COORDINATOR_PORT}),
    *_env({"NNODES": args.NUM_SLICES * s.hosts, "HOSTS_PER_SLICE": s.hosts}),
  ]
  if args.NUM_SLICES > 1:
    env += _env(
      {
        "MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator}:{MEGASCALE_PORT}",
        "MEGASCALE_PORT": MEGASCALE_PORT,
        "MEGASCALE_NUM_SLICES": args.NUM_SLICES,
        "MEGASCALE_SLICE_ID": "$(SLICE_INDEX)",
      }
    )
  return env


def gpu_env(args: argparse.Namespace) -> list[dict]:
  coordinator = f"{args.RUN_NAME}-node-0-0.{args.RUN_NAME}"
  return [
    _field("NODE_RANK", "batch.kubernetes.io/job-completion-index"),
    *_env({"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_COORDINATOR_PORT": args.COORDINATOR_PORT}),
    *_env({"NNODES": args.NUM_NODES, "GPUS_PER_NODE": args.GPUS_PER_NODE}),
  ]


def container_script(args: argparse.Namespace) -> str:
  """What each container runs: the rank (TPU) or the XLA flags (GPU), then --COMMAND from the image's folder."""
  if args.DEVICE == "tpu":
    first = "export NODE_RANK=$((SLICE_INDEX * HOSTS_PER_SLICE + JOB_COMPLETION_INDEX))  # global process rank\n"
  else:
    first = f"source {XLA_RECIPE}  # the A3 Mega XLA flags (appended to XLA_FLAGS)\n"
  # Kubernetes sends SIGTERM to the container's PID 1 only: this shell, which would neither die of it (PID 1)
  # nor pass it on. The trap passes it to the command's whole process group, whose train.py then saves a
  # checkpoint and exits (docs/failures.md) within terminationGracePeriodSeconds. The trap is set before the
  # command starts (a signal in between would kill this shell); one that lands before $child is known is
  # remembered and passed on as soon as it is.
  return (
    f"set -uo pipefail\n{first}child= stop=\n"
    "trap 'stop=1; [ -n \"$child\" ] && kill -TERM -- -$child' TERM INT\n"
    f"setsid bash -c {shlex.quote(args.COMMAND)} & child=$!\n"
    '[ -n "$stop" ] && kill -TERM -- -$child\n'
    "wait $child; status=$?\n"
    "while kill -0 $child 2>/dev/null; do wait $child; status=$?; done  # a trap ended the first wait early\n"
    "exit $status\n"
  )


def pod_spec(args: argparse.Namespace, env: list[dict], limits: dict, node_selector: dict) -> dict:
  container = {
    "name": CONTAINER,
    "image": args.IMAGE,
    "command": ["bash", "-c", container_script(args)],
    "env": env,
    "resources": {"limits": limits},
  }
  spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": GRACE_PERIOD_S, "nodeSelector": node_selector}
  if args.DEVICE == "tpu":
    # As GKE's multi-host TPU jobs: the host's network (ICI/DCN set-up ports), cluster DNS still resolving.
    spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    container["securityContext"] = {"privileged": True}
  else:
    # NCCL's buffers live in /dev/shm; a container's default 64 MiB is too small for 8 GPUs.
    spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
  spec["containers"] = [container]
  return spec


def replicated_job(name: str, replicas: int, pods: int, pod: dict) -> dict:
  job = {"parallelism": pods, "completions": pods, "completionMode": "Indexed", "backoffLimit": 0}
  return {"name": name, "replicas": replicas, "template": {"spec": {**job, "template": {"spec": pod}}}}


def manifest(args: argparse.Namespace) -> dict:
  """The JobSet for args (see the module docstring); ValueError for an unknown --TPU_TYPE/--MACHINE_TYPE."""
  if args.DEVICE == "tpu":
    s = tpu_slice(args.TPU_TYPE)
    selector = {"cloud.google.com/gke-tpu-accelerator": s.accelerator, "cloud.google.com/gke-tpu-topology": s.topology}
    pod = pod_spec(args, tpu_env(args, s), {"google.com/tpu": s.chips_per_host}, selector)
    job = replicated_job("slice", args.NUM_SLICES, s.hosts, pod)
  else:
    if args.MACHINE_TYPE not in GPU_ACCELERATORS:
      known = ", ".join(GPU_ACCELERATORS)
      raise ValueError(f"--MACHINE_TYPE={args.MACHINE_TYPE} has no GKE GPU label here; use one of {known}")
    selector = {"cloud.google.com/gke-accelerator": GPU_ACCELERATORS[args.MACHINE_TYPE]}
    pod = pod_spec(args, gpu_env(args), {"nvidia.com/gpu": args.GPUS_PER_NODE}, selector)
    job = replicated_job("node", 1, args.NUM_NODES, pod)
  metadata = {"name": args.RUN_NAME}
  if args.NAMESPACE:
    metadata["namespace"] = args.NAMESPACE
  if args.DEVICE == "tpu":  # each slice's pods on one node pool (one TPU slice), never two slices on one
    metadata["annotations"] = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  # The coordinator address is a pod's DNS name: the headless service must exist and list pods before they
  # are ready (both JobSet's defaults, written out because the address depends on them).
  network = {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
  spec = {"failurePolicy": {"maxRestarts": args.MAX_RESTARTS}, "network": network, "replicatedJobs": [job]}
  return {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata, "spec": spec}


def kubectl(args: argparse.Namespace, *words: str) -> list[str]:
  return ["kubectl", *words] + [f"--namespace={args.NAMESPACE}"] * bool(args.NAMESPACE)


def submit(args: argparse.Namespace) -> int:
  """--DRY_RUN: print the manifest and the kubectl command; else write it and `kubectl apply` it.

  Returns the exit status (kubectl's when it fails; 2 for a bad --TPU_TYPE/--MACHINE_TYPE).
  """
  try:
    text = to_yaml(manifest(args))
  except ValueError as e:
    print(f"multihost_job: {e}", file=sys.stderr)
    return 2
  path = os.path.join(args.WORKDIR, "jobset.yaml")
  apply = kubectl(args, "apply", "-f", path)
  if args.DRY_RUN:
    print(f"# file: {path}\n{text.rstrip()}\n# end of file: {path}\n# run: {shlex.join(apply)}")
    return 0
  os.makedirs(args.WORKDIR, exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  print("multihost_job: " + shlex.join(apply), flush=True)
  status = subprocess.run(apply).returncode
  if status:
    return status
  job0 = f"{args.RUN_NAME}-{'slice' if args.DEVICE == 'tpu' else 'node'}-0"  # job 0; its pod 0 is rank 0
  rank0 = f"batch.kubernetes.io/job-name={job0},batch.kubernetes.io/job-completion-index=0"
  status_command = shlex.join(kubectl(args, "get", "jobset", args.RUN_NAME))
  print(f"multihost_job: submitted JobSet {args.RUN_NAME}; its status: {status_command}")
  print(f"multihost_job: logs of rank 0: {shlex.join(kubectl(args, 'logs', '-f', '-l', rank0))}")
  print(f"multihost_job: to stop and delete it: {shlex.join(kubectl(args, 'delete', 'jobset', args.RUN_NAME))}")
  return 0
