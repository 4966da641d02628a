"""`multihost_job.py --PLATFORM=slurm`: an sbatch script that runs one command on every task, submitted with
sbatch, its log followed on request.

The job: --NUM_NODES nodes x --TASKS_PER_NODE tasks (default one per GPU, --GPUS_PER_NODE; one per node
when --GPUS_PER_NODE=0). Every task runs --COMMAND through `srun` from --SCRIPT_DIR, which all nodes see
(Slurm clusters share a filesystem, so nothing is uploaded). The tasks find each other from Slurm's own
variables (MaxText/distributed.py: SLURM_PROCID, SLURM_NTASKS, the step's node list).

Preemption: `--signal=TERM@<SIGNAL_S>` sends SIGTERM to every task that long before the time limit, as
`scancel --signal=TERM <job>` does at any time; train.py then saves a checkpoint and exits 75
(docs/failures.md). The batch script requeues the job itself on 75 (up to --REQUEUES times) and the
requeued job, same run_name, resumes from that checkpoint. `--requeue` lets Slurm requeue it too (node
failure, preemption with PreemptMode=REQUEUE).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

# JobState values after which the job runs no more. PREEMPTED and NODE_FAIL are left out: a job with
# --requeue comes back from them (REQUEUED, PENDING, RUNNING); one that does not is followed until Slurm
# forgets it (MinJobAge, 300 s by default).
FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "OUT_OF_MEMORY", "TIMEOUT"}
MISSES = 5  # scontrol answers without the job this many times in a row: the job is gone
POLL_S = 1.0  # how often --TAIL reads the log and asks scontrol about the job


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The Slurm flags (--NUM_NODES and --GPUS_PER_NODE are shared with Vertex and defined there)."""
  g = parser.add_argument_group("Slurm (--PLATFORM=slurm; the code is run in place from --SCRIPT_DIR)")
  g.add_argument("--TASKS_PER_NODE", type=int, default=0, help="processes per node (0: one per GPU; 1 with no GPUs)")
  g.add_argument("--PARTITION", default="", help="Slurm partition (default: the cluster's default)")
  g.add_argument("--TIME", default="", help="time limit, e.g. 24:00:00 (default: the partition's)")
  g.add_argument(
    "--SIGNAL_S", type=int, default=300, help="seconds before the time limit at which every task gets SIGTERM"
  )
  g.add_argument("--REQUEUES", type=int, default=3, help="times the job requeues itself after a stop on a signal")
  g.add_argument("--LOG_DIR", default="", help="folder of the job's log (default: <SCRIPT_DIR>/slurm_logs)")
  g.add_argument("--SBATCH_ARGS", default="", help="more sbatch options, e.g. '--account=a --qos=high --exclusive'")
  g.add_argument("--ENV", action="append", default=[], metavar="KEY=VALUE", help="exported for every task (repeatable)")
  g.add_argument("--TAIL", action="store_true", help="follow the log until the job ends; exit with its status")


def check_arguments(args: argparse.Namespace) -> str | None:
  """What is wrong with the Slurm flags, in one line, or None."""
  if args.GPUS_PER_NODE < 0 or args.TASKS_PER_NODE < 0 or args.SIGNAL_S < 0 or args.REQUEUES < 0:
    return "--GPUS_PER_NODE, --TASKS_PER_NODE, --SIGNAL_S and --REQUEUES must be >= 0"
  bad = [e for e in args.ENV if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", e, flags=re.S)]
  if bad:
    return f"--ENV takes KEY=VALUE, not {bad[0]!r}"
  return None


def tasks_per_node(args: argparse.Namespace) -> int:
  return args.TASKS_PER_NODE or args.GPUS_PER_NODE or 1


def log_dir(args: argparse.Namespace) -> str:
  return os.path.abspath(args.LOG_DIR or os.path.join(args.SCRIPT_DIR, "slurm_logs"))


def log_path(args: argparse.Namespace, job_id: str) -> str:
  return os.path.join(log_dir(args), f"{args.RUN_NAME}-{job_id}.out")


def sbatch_options(args: argparse.Namespace) -> list[str]:
  options = [f"--job-name={args.RUN_NAME}", f"--nodes={args.NUM_NODES}", f"--ntasks-per-node={tasks_per_node(args)}"]
  options += [f"--gpus-per-node={args.GPUS_PER_NODE}"] * bool(args.GPUS_PER_NODE)
  options += [f"--partition={args.PARTITION}"] * bool(args.PARTITION) + [f"--time={args.TIME}"] * bool(args.TIME)
  options += [f"--chdir={os.path.abspath(args.SCRIPT_DIR)}", f"--output={log_path(args, '%j')}"]
  # A requeued job appends to the same log, so one file tells the whole run.
  options += ["--open-mode=append", f"--signal=TERM@{args.SIGNAL_S}", "--requeue"]
  return options + shlex.split(args.SBATCH_ARGS)


def task_command(command: str) -> str:
  """What srun runs in every task. bash traps SIGTERM (and SIGINT, SIGHUP) so that, signalled with the
  train command, it waits for it: an untrapped bash would exit at once and Slurm, seeing the task end, would
  kill train.py before its checkpoint. The command itself starts with the default handling."""
  return f"trap : TERM INT HUP; {command}"


def batch_script(args: argparse.Namespace) -> str:
  """The sbatch script: options, the environment, srun of the command on every task, the requeue on 75."""
  header = "".join(f"#SBATCH {option}\n" for option in sbatch_options(args))
  exports = "".join(f"export {key}={shlex.quote(value)}\n" for key, value in (e.split("=", 1) for e in args.ENV))
  srun = shlex.join(["srun", "--label", "bash", "-c", task_command(args.COMMAND)])
  return f"""#!/bin/bash
# {args.RUN_NAME}: {args.NUM_NODES} node(s) x {tasks_per_node(args)} task(s); every task runs the same command.
# Written by multihost_job.py --PLATFORM=slurm; submit with: sbatch --parsable <this file>
{header}set -u
{exports}echo "multihost_job: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST"
{srun}
status=$?
echo "multihost_job: the tasks exited with status $status"
# 75: stopped on SIGTERM (time limit, preemption, scancel --signal=TERM) with a checkpoint saved; run again.
if [ "$status" = 75 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {args.REQUEUES} ]; then
  echo "multihost_job: requeueing job $SLURM_JOB_ID to resume from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit $status
"""


def sbatch_command(script_path: str) -> list[str]:
  return ["sbatch", "--parsable", script_path]


def plan(args: argparse.Namespace, workdir: str) -> tuple[dict[str, str], list[list[str]]]:
  """The files to write (path -> text) and the commands to run: the script and its sbatch."""
  path = os.path.join(workdir, "slurm_job.sh")
  return {path: batch_script(args)}, [sbatch_command(path)]


def job_state(job_id: str) -> tuple[str, int | None]:
  """(JobState, exit status) from `scontrol show job`; ("", None) once Slurm has forgotten the job. The status
  of a batch script ended by a signal is 128 + the signal, as a shell reports it."""
  result = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
  fields = dict(re.findall(r"(\w+)=(\S*)", result.stdout))
  code = re.fullmatch(r"(\d+):(\d+)", fields.get("ExitCode", ""))
  status = None if code is None else (128 + int(code[2]) if int(code[2]) else int(code[1]))
  return fields.get("JobState", ""), status


def tail(job_id: str, path: str) -> int:
  """Print the log as it grows until the job has ended (through any requeues); the job's exit status."""
  offset, misses = 0, 0
  while True:
    state, status = job_state(job_id)
    misses = 0 if state else misses + 1
    done = state in FINAL_STATES or misses >= MISSES
    if os.path.exists(path):
      with open(path, errors="replace") as f:
        f.seek(offset)
        sys.stdout.write(f.read())
        offset = f.tell()
      sys.stdout.flush()
    if done:
      break
    time.sleep(POLL_S)
  print(f"multihost_job: job {job_id} ended: {state or 'gone from scontrol'}, exit status {status}", flush=True)
  return 1 if status is None else status


def submit(args: argparse.Namespace) -> int:
  """--DRY_RUN: print the script and the sbatch command. Else write the script, sbatch it, print the job id and
  the log path, and with --TAIL follow the log. The exit status."""
  files, commands = plan(args, args.WORKDIR)
  if args.DRY_RUN:  # the format of multihost_job.print_dry_run (nothing to upload)
    for path, text in files.items():
      print(f"# file: {path}\n{text.rstrip()}\n# end of file: {path}")
    print("# run: " + shlex.join(commands[0]))
    return 0
  for path, text in files.items():
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
  os.makedirs(log_dir(args), exist_ok=True)
  (command,) = commands
  print("multihost_job: " + shlex.join(command), flush=True)
  try:
    result = subprocess.run(command, capture_output=True, text=True)
  except FileNotFoundError:
    print("multihost_job: sbatch not found: run this on a Slurm login node (or put sbatch on PATH)", file=sys.stderr)
    return 1
  if result.returncode:
    print(f"multihost_job: sbatch failed: {result.stderr.strip()}", file=sys.stderr)
    return 1
  job_id = result.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
  path = log_path(args, job_id)
  print(f"multihost_job: submitted {args.RUN_NAME} as Slurm job {job_id}; log: {path}", flush=True)
  print(f"multihost_job: follow it with: tail -F {path}")
  print(f"multihost_job: stop it with a checkpoint (it requeues and resumes): scancel --signal=TERM {job_id}")
  return tail(job_id, path) if args.TAIL else 0
