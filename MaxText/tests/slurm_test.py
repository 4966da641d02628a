"""multihost_job.py --PLATFORM=slurm: the sbatch script (golden file, flag checks), Slurm's environment -> the
jax.distributed plan, and, against a real one-node Slurm on 127.0.0.1 (slurm_cluster.py; tier `slurm`), one job
of two tasks that trains, is stopped with `scancel --signal=TERM`, exits 75 with a checkpoint, requeues itself
and resumes from that checkpoint to the end. UPDATE_GOLDENS=1 rewrites the golden file."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from MaxText import distributed
from MaxText.tests import slurm_cluster
from MaxText.tests.conftest import BASE, ROOT, TINY, cfg

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "multihost_job_slurm.txt")
STEPS = 40


def multihost_job(*args, env=None, timeout=60):
  command = [sys.executable, "multihost_job.py", "--PLATFORM=slurm", *args]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_dry_run_matches_golden():
  train = "python3 MaxText/train.py MaxText/configs/base.yml run_name=big base_output_directory=/shared/out"
  result = multihost_job(
    "--RUN_NAME=big", "--NUM_NODES=4", "--GPUS_PER_NODE=8", "--PARTITION=h100", "--TIME=24:00:00",
    "--SBATCH_ARGS=--account=llm --exclusive", "--ENV", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9",
    "--SCRIPT_DIR=/shared/maxtext", f"--COMMAND={train}", "--DRY_RUN",
  )  # fmt: skip
  assert result.returncode == 0, result.stderr
  got = result.stdout.replace(os.path.join(tempfile.gettempdir(), "multihost_job_"), "<TMP>/multihost_job_")
  if os.environ.get("UPDATE_GOLDENS"):
    with open(GOLDEN, "w") as f:
      f.write(got)
  with open(GOLDEN) as f:
    assert got == f.read()
  # The script as bash reads it: no syntax errors.
  script = got.split("# file: <TMP>/multihost_job_big/slurm_job.sh\n")[1].split("# end of file")[0]
  assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_flags_slurm_needs_no_bucket_and_checks_its_own():
  assert multihost_job("--RUN_NAME=x", "--COMMAND=true", "--DRY_RUN").returncode == 0
  tpu = subprocess.run(
    [sys.executable, "multihost_job.py", "--RUN_NAME=x", "--COMMAND=true", "--DRY_RUN"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert tpu.returncode == 2 and "--PLATFORM=tpu needs --BUCKET_NAME" in tpu.stderr
  bad = multihost_job("--RUN_NAME=x", "--COMMAND=true", "--DRY_RUN", "--ENV", "no-equals")
  assert bad.returncode == 2 and "--ENV takes KEY=VALUE, not 'no-equals'" in bad.stderr
  # One task per GPU; one per node without GPUs; --TASKS_PER_NODE wins.
  for flags, line in [
    ([], "--ntasks-per-node=8"),
    (["--GPUS_PER_NODE=0"], "--ntasks-per-node=1"),
    (["--GPUS_PER_NODE=8", "--TASKS_PER_NODE=1"], "--ntasks-per-node=1"),
  ]:
    out = multihost_job("--RUN_NAME=x", "--COMMAND=true", "--DRY_RUN", *flags).stdout
    assert f"#SBATCH {line}\n" in out and ("--gpus-per-node" in out) == ("--GPUS_PER_NODE=0" not in flags)


def test_sbatch_missing_is_one_line(tmp_path):
  env = {**os.environ, "PATH": str(tmp_path)}  # no sbatch
  result = multihost_job("--RUN_NAME=x", "--COMMAND=true", f"--SCRIPT_DIR={tmp_path}", env=env)
  assert result.returncode == 1 and "sbatch not found" in result.stderr and "Traceback" not in result.stderr


# A task of `srun` in a job of 2 nodes x 8 tasks: what Slurm sets (the ones the plan reads).
TASK = {
  "SLURM_JOB_ID": "1234",
  "SLURM_STEP_NODELIST": "gpu-[003-004]",
  "SLURM_STEP_NUM_NODES": "2",
  "SLURM_STEP_NUM_TASKS": "16",
  "SLURM_NTASKS": "16",
  "SLURM_PROCID": "11",
  "SLURM_LOCALID": "3",
}
PORT = str(1234 % 4096 + 61440)  # as JAX's own Slurm detection picks it


@pytest.mark.parametrize(
  "hardware, changes, expected",
  [
    ("gpu", {}, {"coordinator_address": f"gpu-003:{PORT}", "num_processes": 16, "process_id": 11, "local": [3]}),
    # One task per node: it keeps all the node's GPUs.
    ("gpu", {"SLURM_STEP_NUM_NODES": "16", "SLURM_STEP_NODELIST": "n[1-16]"}, {"coordinator_address": f"n1:{PORT}"}),
    # Slurm bound the task to one GPU (--gpus-per-task=1): it sees only that one.
    ("gpu", {"CUDA_VISIBLE_DEVICES": "3"}, {"local": None}),
    ("cpu", {"JAX_COORDINATOR_PORT": "7000"}, {"coordinator_address": "gpu-003:7000", "local": None}),
  ],
)
def test_plan_from_slurm_environment(tmp_path, hardware, changes, expected):
  plan = distributed.plan(cfg(tmp_path, "p", f"hardware={hardware}"), {**TASK, **changes})
  assert plan.how == "slurm" and "Slurm task" in plan.describe
  assert plan.kwargs["cluster_detection_method"] == "deactivate"  # JAX must not set local_device_ids itself
  want = {"coordinator_address": f"gpu-003:{PORT}", "num_processes": 16, "process_id": 11, "local": None, **expected}
  got = {k: plan.kwargs.get(k) for k in ("coordinator_address", "num_processes", "process_id")}
  assert {**got, "local": plan.kwargs.get("local_device_ids")} == want


def test_batch_script_and_one_task_steps_are_single_process(tmp_path):
  config = cfg(tmp_path, "p", "hardware=gpu")
  batch = {k: v for k, v in TASK.items() if not k.startswith("SLURM_STEP")} | {"SLURM_JOB_NODELIST": "gpu-[003-004]"}
  assert distributed.plan(config, batch) is None  # the batch script itself, outside srun
  assert distributed.plan(config, {**TASK, "SLURM_STEP_NUM_TASKS": "1"}) is None


NODELISTS = {
  "node001": "node001",
  "node001,login2": "node001",
  "gpu-[003-010,012],login1": "gpu-003",
  "a[7,2-3]": "a7",
  "rack[1-2]-n[01-02]": "rack1-n01",
}


@pytest.mark.parametrize("nodelist", sorted(NODELISTS))
def test_first_host_of_a_node_list(nodelist):
  assert distributed.first_host(nodelist) == NODELISTS[nodelist]


# ------------------------------------------------------------------ against a real Slurm (tier `slurm`)


@pytest.fixture(scope="module")
def cluster():
  if reason := slurm_cluster.missing():
    pytest.skip(f"no Slurm to test against: {reason}")
  root = tempfile.mkdtemp(prefix="slurm-")  # short: munged's socket path must fit in 108 bytes
  try:
    with slurm_cluster.Cluster(root) as c:
      yield c
  finally:
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def stopped_job(cluster, tmp_path_factory):
  """One submission, followed with --TAIL: `scancel --signal=TERM` once step 2 is logged; the job stops with a
  checkpoint (75), requeues itself and resumes to the end. (multihost_job's output, its status, the run dir)."""
  out = tmp_path_factory.mktemp("slurm_job")
  train = [sys.executable, "MaxText/train.py", BASE, "run_name=job", f"base_output_directory={out}", *TINY]
  train += [f"steps={STEPS}", "per_device_batch_size=2", "hardware=cpu", "enable_checkpointing=true"]
  train += ["checkpoint_period=1000", "async_checkpointing=false", "dcn_data_parallelism=2", "ici_fsdp_parallelism=1"]
  args = ["--RUN_NAME=job", "--GPUS_PER_NODE=0", "--TASKS_PER_NODE=2", "--REQUEUES=1", f"--LOG_DIR={out}"]
  # One CPU device per task; the requeued run reads its compiled steps from JAX's persistent cache.
  args += ["--ENV", "XLA_FLAGS=--xla_force_host_platform_device_count=1", "--ENV", "JAX_PLATFORMS=cpu"]
  args += ["--ENV", f"JAX_COMPILATION_CACHE_DIR={out}/jax_cache"]
  args += [f"--SCRIPT_DIR={ROOT}", f"--COMMAND={shlex.join(train)}", "--TAIL"]
  command = [sys.executable, "multihost_job.py", "--PLATFORM=slurm", *args]
  pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
  proc = subprocess.Popen(command, cwd=ROOT, env=cluster.env, **pipe)
  watchdog = threading.Timer(600, proc.kill)
  watchdog.start()
  lines, job_id, signalled = [], None, False
  for line in proc.stdout:
    lines.append(line)
    job_id = job_id or (m := re.search(r"as Slurm job (\d+)", line)) and m[1]
    if line.startswith("0: step 2/") and not signalled:
      cancel, signalled = cluster.run("scancel", "--signal=TERM", job_id), True
      lines.append(f"test: scancel --signal=TERM {job_id}: status {cancel.returncode} {cancel.stderr}\n")
  proc.wait()
  watchdog.cancel()
  return "".join(lines), proc.returncode, os.path.join(out, "job")


def stop_step(log):
  stops = set(re.findall(r"^(\d): Stopped at step (\d+): SIGTERM received;", log, re.M))
  assert {rank for rank, _ in stops} == {"0", "1"} and len({step for _, step in stops}) == 1, log[-4000:]
  return int(stops.pop()[1])


# One test, not three: under pytest-xdist each worker would start its own cluster and job for its share.
@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_trains_stops_on_scancel_with_a_checkpoint_and_its_requeue_resumes(stopped_job):
  log, status, run_dir = stopped_job
  assert status == 0, log[-4000:]
  step = stop_step(log)

  # a) Two tasks form one jax.distributed job and train the tiny model to a checkpoint.
  assert "0: jax.distributed: Slurm task 0 of 2 with coordinator localhost:" in log
  assert "mesh     data 2 (2 cpu devices)" in log  # two processes of one device each, one job
  assert f"0: step {STEPS}/{STEPS} | checkpoint saved: {run_dir}/checkpoints/{STEPS}/state" in log
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == list(range(1, STEPS + 1))  # stopped, resumed, nothing lost or repeated

  # b) scancel --signal=TERM: a checkpoint at the step both tasks name, and both exit 75.
  assert 2 <= step < STEPS and os.path.isdir(os.path.join(run_dir, "checkpoints", str(step)))
  assert re.search(r"srun: error: localhost: tasks? 0(-1)?: Exited with exit code 75", log), log[-4000:]
  assert "multihost_job: the tasks exited with status 75\nmultihost_job: requeueing job" in log

  # c) The requeued job (same id, same log) resumes from that checkpoint and runs to the end.
  resumed = log.split("(restart 1) on localhost")[1]
  assert f"0: run job: steps {step} -> {STEPS} | start: resume from step {step}" in resumed
  assert re.search(r"multihost_job: job \d+ ended: COMPLETED, exit status 0", resumed)


def test_first_host_agrees_with_scontrol(tmp_path):
  if not shutil.which("scontrol"):
    pytest.skip("scontrol not installed (apt-get install slurm-client)")
  (tmp_path / "slurm.conf").write_text(slurm_cluster.slurm_conf(str(tmp_path)))  # scontrol needs one; no daemons
  env = {**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")}
  for nodelist, first in NODELISTS.items():
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True)
    assert hosts.stdout.split()[0] == first, hosts.stderr


@pytest.mark.parametrize("exit_code, status", [("75:0", 75), ("0:15", 143)])
def test_tail_prints_the_log_until_the_job_ends(tmp_path, monkeypatch, capsys, exit_code, status):
  from MaxText.launchers import slurm

  # A stand-in scontrol: the job runs twice (a requeue between), then ends with exit_code.
  states = ["RUNNING", "REQUEUED", "PENDING", "RUNNING", "COMPLETED" if exit_code == "75:0" else "FAILED"]
  (tmp_path / "states").write_text("\n".join(states) + "\n")
  scontrol = tmp_path / "scontrol"
  scontrol.write_text(
    f"#!/bin/bash\nstate=$(head -n1 {tmp_path}/states); sed -i 1d {tmp_path}/states\n"
    f"echo 'JobId=7 JobName=x JobState='$state' Reason=None ExitCode={exit_code}'\n"
  )
  scontrol.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
  monkeypatch.setattr(slurm, "POLL_S", 0.0)
  (tmp_path / "x-7.out").write_text("0: step 1/2\n")
  assert slurm.tail("7", str(tmp_path / "x-7.out")) == status
  out = capsys.readouterr().out
  assert out.startswith("0: step 1/2\n") and f"job 7 ended: {states[-1]}, exit status {status}" in out
