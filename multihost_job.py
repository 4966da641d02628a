"""Submit a production job: the code goes to a bucket, the machines fetch and run it, logs come back.

TPU (queued resource; --NUM_SLICES slices of --TPU_TYPE, created and started by the startup script):
  python3 multihost_job.py --RUN_NAME=big --BUCKET_NAME=my-bucket --TPU_TYPE=v5litepod-256 --NUM_SLICES=2 \
    --ZONE=us-east5-b --PROJECT=my-project --COMMAND="DEVICE=tpu bash setup.sh && python3 MaxText/train.py ..."
GPU (Vertex AI custom job; --NUM_NODES nodes of --MACHINE_TYPE, one process per node):
  python3 multihost_job.py --PLATFORM=vertex --RUN_NAME=big --BUCKET_NAME=my-bucket --NUM_NODES=2 \
    --REGION=us-central1 --IMAGE=us-docker.pkg.dev/.../jax:latest --COMMAND="python3 MaxText/train.py ..."
Kubernetes (a JobSet on GKE: TPU slices, or --DEVICE=gpu A3 nodes; the code comes in --IMAGE, no bucket):
  python3 multihost_job.py --PLATFORM=jobset --RUN_NAME=big --TPU_TYPE=v5litepod-256 --NUM_SLICES=2 \
    --IMAGE=us-docker.pkg.dev/.../maxtext:tpu --COMMAND="python3 MaxText/train.py ..."
  (MaxText/launchers/kubernetes.py writes the manifest; --DRY_RUN prints it, else `kubectl apply` submits it.)
Slurm (an sbatch script: --NUM_NODES nodes x --TASKS_PER_NODE tasks, one per GPU by default, run in place from
--SCRIPT_DIR on the shared filesystem; no bucket; MaxText/launchers/slurm.py):
  python3 multihost_job.py --PLATFORM=slurm --RUN_NAME=big --NUM_NODES=4 --GPUS_PER_NODE=8 --TIME=24:00:00 \
    --COMMAND="python3 MaxText/train.py ..." --TAIL

Steps: (1) a .tar.gz of --SCRIPT_DIR is uploaded to gs://<BUCKET_NAME>/<RUN_NAME>/code/ with
google-cloud-storage; (2) a startup script that downloads it, runs --COMMAND with every host's log
saved and uploads the logs to gs://<BUCKET_NAME>/<RUN_NAME>/logs/ at the end; (3) the queued
resource (TPU) or custom job (Vertex, with the replica pools, the JAX_COORDINATOR_*/NNODES/NODE_RANK/
GPUS_PER_NODE environment and the A3 Mega XLA flags) is created with gcloud; (4) TPU: when the command
ends, worker 0 of slice 0 deletes the queued resource after --DELETE_AFTER_S seconds (not with
--KEEP_TPUS; the submit output prints the delete command). --DRY_RUN prints every command and file
instead of running or uploading anything.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile

from MaxText import cli
from MaxText.launchers import slurm, to_yaml

ROOT = os.path.dirname(os.path.abspath(__file__))
XLA_RECIPE = os.path.join(ROOT, "end_to_end", "gpu", "a3mega_xla_flags.sh")


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = _parser()
  args = p.parse_args(argv)
  args.WORKDIR = os.path.join(tempfile.gettempdir(), f"multihost_job_{args.RUN_NAME}")
  _check(p, args)
  return args


def _parser() -> argparse.ArgumentParser:
  p = cli.parser("python3 multihost_job.py", __doc__, "docs/multihost.md")
  p.add_argument("--RUN_NAME", required=True, help="job name; code and logs go under gs://<BUCKET_NAME>/<RUN_NAME>/")
  p.add_argument("--BUCKET_NAME", default="", help="GCS bucket (with or without gs://); tpu and vertex only")
  p.add_argument("--COMMAND", required=True, help="shell command every host runs from the unpacked code")
  p.add_argument(
    "--PLATFORM", default="tpu", choices=("tpu", "vertex", "jobset", "slurm"),
    help="tpu: queued resource; vertex: GPUs; jobset: a Kubernetes JobSet (TPU or GPU, code in --IMAGE); slurm",
  )  # fmt: skip
  p.add_argument("--PROJECT", default="", help="gcloud project (default: gcloud's)")
  p.add_argument("--SCRIPT_DIR", default=os.getcwd(), help="local folder to upload and run from")
  p.add_argument("--DRY_RUN", action="store_true", help="print every command and file; run and upload nothing")
  tpu = p.add_argument_group("TPU (queued resources)")
  tpu.add_argument("--TPU_TYPE", default="v5litepod-16", help="accelerator type of one slice, e.g. v5litepod-256")
  tpu.add_argument("--NUM_SLICES", type=int, default=1, help="slices (TPU VMs) in the queued resource")
  tpu.add_argument("--ZONE", default="", help="zone of the TPUs (default: gcloud's)")
  tpu.add_argument("--VERSION", default="tpu-ubuntu2204-base", help="TPU VM runtime version")
  tpu.add_argument("--CQR_EXTRA_ARGS", default="", help="extra flags for `queued-resources create`")
  tpu.add_argument("--KEEP_TPUS", action="store_true", help="keep the queued resource when the job ends")
  tpu.add_argument(
    "--DELETE_AFTER_S", type=int, default=300, help="seconds worker 0 waits for the other workers' logs before deleting"
  )
  gpu = p.add_argument_group("GPU (Vertex AI custom job)")
  gpu.add_argument("--NUM_NODES", type=int, default=1, help="GPU nodes (one process each)")
  gpu.add_argument("--REGION", default="us-central1", help="Vertex AI region")
  gpu.add_argument("--MACHINE_TYPE", default="a3-megagpu-8g", help="Compute Engine machine type of a node")
  gpu.add_argument("--ACCELERATOR_TYPE", default="NVIDIA_H100_MEGA_80GB", help="Vertex accelerator type")
  gpu.add_argument("--GPUS_PER_NODE", type=int, default=8, help="GPUs per node")
  gpu.add_argument("--IMAGE", default="", help="vertex: image with Python and JAX (CUDA); jobset: see below")
  gpu.add_argument("--COORDINATOR_PORT", type=int, default=6002, help="JAX_COORDINATOR_PORT")
  k8s = p.add_argument_group("Kubernetes (--PLATFORM=jobset; --IMAGE: built from the Dockerfile, holding the code)")
  k8s.add_argument(
    "--DEVICE",
    default="tpu",
    choices=("tpu", "gpu"),
    help="tpu: --TPU_TYPE x --NUM_SLICES; gpu: "
    "--NUM_NODES x --MACHINE_TYPE (a3-highgpu-8g, a3-megagpu-8g), --GPUS_PER_NODE",
  )
  k8s.add_argument("--NAMESPACE", default="", help="Kubernetes namespace (default: kubectl's)")
  k8s.add_argument("--MAX_RESTARTS", type=int, default=0, help="JobSet restarts after a failure (runs resume)")
  slurm.add_arguments(p)
  return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """p.error (exit 2, usage) for settings the platform cannot run; BUCKET_NAME without gs:// and slashes."""
  if args.PLATFORM == "jobset" and not args.IMAGE:
    p.error("--PLATFORM=jobset needs --IMAGE (built from the Dockerfile: docs/multihost.md, Container images)")
  if args.PLATFORM == "jobset" and args.BUCKET_NAME:
    p.error("--PLATFORM=jobset takes no --BUCKET_NAME: the code comes in --IMAGE (outputs: base_output_directory)")
  if args.PLATFORM in ("tpu", "vertex") and not args.BUCKET_NAME:
    p.error(f"--PLATFORM={args.PLATFORM} needs --BUCKET_NAME (the code and the logs go there)")
  if args.PLATFORM == "slurm" and (problem := slurm.check_arguments(args)):
    p.error(problem)
  args.BUCKET_NAME = args.BUCKET_NAME.removeprefix("gs://").rstrip("/")
  if args.PLATFORM == "vertex" and not args.IMAGE:
    p.error("--PLATFORM=vertex needs --IMAGE (Python and JAX for CUDA: the Dockerfile's gpu target builds one)")
  if min(args.NUM_SLICES, args.NUM_NODES) < 1:
    p.error("--NUM_SLICES and --NUM_NODES must be >= 1")


def code_object(args: argparse.Namespace) -> str:
  return f"{args.RUN_NAME}/code/{args.RUN_NAME}.tar.gz"


def make_archive(script_dir: str, path: str) -> None:
  """script_dir as a .tar.gz without .git and caches (the hosts install their own packages)."""
  skip = (".git", "__pycache__", ".venv", ".ruff_cache", ".pytest_cache")
  with tarfile.open(path, "w:gz") as tar:
    tar.add(script_dir, arcname=".", filter=lambda i: None if os.path.basename(i.name) in skip else i)


def upload(args: argparse.Namespace, archive: str) -> None:
  """Upload with google-cloud-storage (honours STORAGE_EMULATOR_HOST, used by the tests)."""
  from google.cloud import storage  # lazy: only job submission needs it

  if os.environ.get("STORAGE_EMULATOR_HOST"):
    from google.auth.credentials import AnonymousCredentials

    client = storage.Client(project=args.PROJECT or "test", credentials=AnonymousCredentials())
  else:
    client = storage.Client(project=args.PROJECT or None)
  client.bucket(args.BUCKET_NAME).blob(code_object(args)).upload_from_filename(archive)


def tpu_startup_script(args: argparse.Namespace) -> str:
  """Runs on every TPU VM at boot: fetch the code, run the command, upload this worker's log."""
  run, bucket = args.RUN_NAME, args.BUCKET_NAME
  log = f"/tmp/{run}/log_slice_${{MEGASCALE_SLICE_ID:-0}}_worker_${{TPU_WORKER_ID:-0}}.txt"
  return f"""#!/bin/bash
# Startup script of {run}: every worker of every slice runs this once at boot.
mkdir -p /tmp/{run} && cd /tmp/{run}
TPU_WORKER_ID=$(curl -s -H 'Metadata-Flavor: Google' \\
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || echo 0)
gcloud storage cp gs://{bucket}/{code_object(args)} code.tar.gz && tar -xzf code.tar.gz
({args.COMMAND}) > {log} 2>&1
status=$?
echo "exit status $status" >> {log}
gcloud storage cp {log} gs://{bucket}/{run}/logs/
{tpu_cleanup(args)}"""


def delete_command(args: argparse.Namespace) -> list[str]:
  """The gcloud command that deletes the job's queued resource (and its TPU VMs)."""
  command = ["gcloud", "alpha", "compute", "tpus", "queued-resources", "delete", args.RUN_NAME, "--force", "--quiet"]
  return command + [f"--project={args.PROJECT}"] * bool(args.PROJECT) + [f"--zone={args.ZONE}"] * bool(args.ZONE)


def tpu_cleanup(args: argparse.Namespace) -> str:
  """Startup-script lines: worker 0 of slice 0 deletes the queued resource when the job ends, after
  --DELETE_AFTER_S seconds in which the other workers finish and upload their logs (none with --KEEP_TPUS)."""
  if args.KEEP_TPUS:
    return f"# --KEEP_TPUS: the queued resource stays; delete it with: {shlex.join(delete_command(args))}\n"
  return f"""# The job has ended: worker 0 of slice 0 releases the TPUs once the others have uploaded their logs.
if [ "${{MEGASCALE_SLICE_ID:-0}}" = 0 ] && [ "$TPU_WORKER_ID" = 0 ]; then
  sleep {args.DELETE_AFTER_S}
  {shlex.join(delete_command(args))} --async
fi
"""


def tpu_commands(args: argparse.Namespace, startup_path: str) -> list[list[str]]:
  create = ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create", args.RUN_NAME]
  create += [f"--accelerator-type={args.TPU_TYPE}", f"--runtime-version={args.VERSION}"]
  create += [f"--node-count={args.NUM_SLICES}", f"--node-prefix={args.RUN_NAME}"]
  create += [f"--metadata-from-file=startup-script={startup_path}"]
  create += [f"--project={args.PROJECT}"] * bool(args.PROJECT) + [f"--zone={args.ZONE}"] * bool(args.ZONE)
  return [create + shlex.split(args.CQR_EXTRA_ARGS)]


def vertex_entrypoint(args: argparse.Namespace) -> str:
  """Runs in every node's container: rank and coordinator from Vertex's CLUSTER_SPEC, then the command.

  Pool 0 holds one replica (rank 0, the coordinator); pool 1 the others (rank 1 + its index).
  Buckets are mounted at /gcs/<bucket> by Vertex (Cloud Storage FUSE), so no gcloud is needed.
  """
  run, bucket = args.RUN_NAME, args.BUCKET_NAME
  with open(XLA_RECIPE) as f:
    recipe = "".join(line for line in f if not line.startswith("#!"))
  return f"""set -uo pipefail
read -r NODE_RANK JAX_COORDINATOR_ADDRESS < <(python3 -c '
import json, os
spec = json.loads(os.environ["CLUSTER_SPEC"])
task = spec["task"]
rank = task["index"] + (1 if task["type"] == "workerpool1" else 0)
print(rank, spec["cluster"]["workerpool0"][0].split(":")[0])')
export NODE_RANK JAX_COORDINATOR_ADDRESS JAX_COORDINATOR_PORT={args.COORDINATOR_PORT}
export NNODES={args.NUM_NODES} GPUS_PER_NODE={args.GPUS_PER_NODE}
{recipe}mkdir -p /tmp/{run} && cd /tmp/{run} && tar -xzf /gcs/{bucket}/{code_object(args)}
export PYTHONPATH="$PWD${{PYTHONPATH:+:$PYTHONPATH}}"  # this code's MaxText first (the images have their own)
mkdir -p /gcs/{bucket}/{run}/logs
({args.COMMAND}) 2>&1 | tee /gcs/{bucket}/{run}/logs/node_$NODE_RANK.txt
exit ${{PIPESTATUS[0]}}
"""


def vertex_job_spec(args: argparse.Namespace) -> dict:
  machine = {
    "machineType": args.MACHINE_TYPE,
    "acceleratorType": args.ACCELERATOR_TYPE,
    "acceleratorCount": args.GPUS_PER_NODE,
  }
  container = {"imageUri": args.IMAGE, "command": ["bash", "-c", vertex_entrypoint(args)]}
  pools = [{"machineSpec": machine, "replicaCount": 1, "containerSpec": container}]
  if args.NUM_NODES > 1:
    pools.append({"machineSpec": machine, "replicaCount": args.NUM_NODES - 1, "containerSpec": container})
  return {"workerPoolSpecs": pools}


def vertex_commands(args: argparse.Namespace, spec_path: str) -> list[list[str]]:
  create = ["gcloud", "ai", "custom-jobs", "create", f"--region={args.REGION}", f"--display-name={args.RUN_NAME}"]
  create += [f"--config={spec_path}"] + [f"--project={args.PROJECT}"] * bool(args.PROJECT)
  return [create]


def plan(args: argparse.Namespace, workdir: str) -> tuple[dict[str, str], list[list[str]]]:
  """The files to write (path -> text) and the gcloud commands to run, in order."""
  if args.PLATFORM == "tpu":
    path = os.path.join(workdir, "startup_script.sh")
    return {path: tpu_startup_script(args)}, tpu_commands(args, path)
  path = os.path.join(workdir, "vertex_job.yaml")
  text = to_yaml(vertex_job_spec(args))
  return {path: text}, vertex_commands(args, path)


def print_dry_run(args: argparse.Namespace, files: dict[str, str], commands: list[list[str]]) -> None:
  print(f"# upload: {args.SCRIPT_DIR} as .tar.gz -> gs://{args.BUCKET_NAME}/{code_object(args)}")
  for path, text in files.items():
    print(f"# file: {path}\n{text.rstrip()}\n# end of file: {path}")
  for command in commands:
    print("# run: " + shlex.join(command))


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first). Exits 1 when a submission command fails."""
  args = parse_args(argv[1:])
  if args.PLATFORM == "jobset":
    from MaxText.launchers import kubernetes  # the manifest and kubectl live there

    sys.exit(kubernetes.submit(args))
  if args.PLATFORM == "slurm":
    sys.exit(slurm.submit(args))
  workdir = args.WORKDIR
  files, commands = plan(args, workdir)
  if args.DRY_RUN:
    print_dry_run(args, files, commands)
    return
  os.makedirs(workdir, exist_ok=True)
  archive = os.path.join(workdir, "code.tar.gz")
  make_archive(args.SCRIPT_DIR, archive)
  upload(args, archive)
  print(f"multihost_job: uploaded the code to gs://{args.BUCKET_NAME}/{code_object(args)}")
  for path, text in files.items():
    with open(path, "w") as f:
      f.write(text)
  for command in commands:
    print("multihost_job: " + shlex.join(command), flush=True)
    if subprocess.run(command).returncode:
      sys.exit(1)
  print(f"multihost_job: submitted {args.RUN_NAME}; logs will appear in gs://{args.BUCKET_NAME}/{args.RUN_NAME}/logs/")
  if args.PLATFORM == "tpu":
    when = "is kept (--KEEP_TPUS)" if args.KEEP_TPUS else "is deleted when the job ends"
    print(f"multihost_job: the queued resource {when}; to delete it now: {shlex.join(delete_command(args))}")


if __name__ == "__main__":
  main(sys.argv)
