"""Multi-process training on one machine: two processes x 4 CPU devices (jax.distributed over
127.0.0.1, gloo collectives) against one process with 8 devices; checkpoints across process counts;
the start-up plan chosen from the environment."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from MaxText import distributed, train
from MaxText.errors import ConfigError, DistributedInitError
from MaxText.tests.conftest import BASE, ROOT, TINY, cfg, cpu_subprocess_env, free_port, run_processes

COMMON = ["steps=10", "per_device_batch_size=2", "hardware=cpu", "enable_checkpointing=true"]
COMMON += ["checkpoint_period=5", "async_checkpointing=false"]


def launch(tmp_path, name, processes, devices_per_process, *overrides, timeout=300):
  """Run train.py as `processes` cooperating processes; returns their (returncode, output) pairs."""
  command = [sys.executable, "MaxText/train.py", BASE, f"run_name={name}", f"base_output_directory={tmp_path}"]
  command += [*TINY, *overrides]
  return run_processes(command, ROOT, tmp_path, name, processes, devices_per_process, timeout)


def records(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_processes_match_one_and_their_checkpoint_restores(tmp_path):
  results = launch(tmp_path, "two", 2, 4, *COMMON, "dcn_data_parallelism=2", "ici_fsdp_parallelism=4")
  for rc, log in results:
    assert rc == 0, log[-3000:]
  assert "mesh     data 2 x fsdp 4 (8 cpu devices)" in results[0][1]  # a 2-slice hybrid mesh
  two = [r["loss"] for r in records(os.path.join(tmp_path, "two", "metrics.jsonl"))]
  assert len(two) == 10  # one writer: process 1 wrote nothing

  one = cfg(tmp_path, "one", *COMMON, "ici_fsdp_parallelism=8", "dcn_data_parallelism=1")
  train.run(one)
  np.testing.assert_allclose([r["loss"] for r in records(one.metrics_file)], two, rtol=1e-5)

  # The 2-process checkpoint at step 5 resumes in one process and continues the same run.
  shutil.copytree(os.path.join(tmp_path, "two"), os.path.join(tmp_path, "resumed"))
  shutil.rmtree(os.path.join(tmp_path, "resumed", "checkpoints", "10"))
  resumed = cfg(tmp_path, "resumed", *COMMON, "ici_fsdp_parallelism=8", "dcn_data_parallelism=1")
  assert train.run(resumed)["steps_run"] == 5
  np.testing.assert_allclose([r["loss"] for r in records(resumed.metrics_file)][10:], two[5:], rtol=1e-5)


def test_unreachable_coordinator_fails_fast_with_a_clear_error(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}"}
  env.update(NNODES="2", NODE_RANK="1")
  command = [
    sys.executable,
    "MaxText/train.py",
    BASE,
    *TINY,
    "hardware=cpu",
    "jax_distributed_initialization_timeout=2",
  ]
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert "not reachable within 2 s" in result.stderr and "process 1 of 2" in result.stderr


def test_processes_started_with_different_nnodes_both_stop_with_one_line(tmp_path):
  # Process 0 says 2 processes, process 1 says 3: JAX would admit process 1 into a 2-process job.
  port, procs = free_port(), []
  for rank, nodes in ((0, 2), (1, 3)):
    env = cpu_subprocess_env(1)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", NNODES=str(nodes), NODE_RANK=str(rank))
    command = [sys.executable, "MaxText/train.py", BASE, *TINY, "hardware=cpu", f"base_output_directory={tmp_path}"]
    procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
  expected = "the processes were started with different job sizes (NNODES of process 0: 2, process 1: 3)"
  for proc in procs:
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("Distributed initialisation failed:")]
    assert len(lines) == 1 and expected in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr and "Check failure" not in stderr


@pytest.mark.parametrize(
  "environ, expected",
  [
    ({}, None),
    (
      {"JAX_COORDINATOR_ADDRESS": "10.0.0.2", "JAX_COORDINATOR_PORT": "6002", "NNODES": "4", "NODE_RANK": "3"},
      {"coordinator_address": "10.0.0.2:6002", "num_processes": 4, "process_id": 3},
    ),
    (
      {"JAX_COORDINATOR_ADDRESS": "h0:1234", "NNODES": "2", "NODE_RANK": "0", "GPUS_PER_NODE": "8"},
      {"coordinator_address": "h0:1234", "num_processes": 2, "process_id": 0, "local_device_ids": list(range(8))},
    ),
    (  # more in slurm_test.py
      {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "h0", "SLURM_NTASKS": "16", "SLURM_PROCID": "3"},
      {"coordinator_address": "h0:61447", "num_processes": 16, "process_id": 3}
      | {"cluster_detection_method": "deactivate"},
    ),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None),
  ],
)
def test_plan_from_environment(tmp_path, environ, expected):
  plan = distributed.plan(cfg(tmp_path, "p", "hardware=gpu"), environ)
  assert (plan and plan.kwargs) == expected


def test_plan_tpu_and_bad_environments(tmp_path):
  assert distributed.plan(cfg(tmp_path, "p", "hardware=tpu"), {}).how == "tpu"
  with pytest.raises(DistributedInitError, match="NODE_RANK"):
    distributed.plan(cfg(tmp_path, "p"), {"JAX_COORDINATOR_ADDRESS": "h0", "NNODES": "2"})
  with pytest.raises(DistributedInitError, match=r"NODE_RANK=2 must be in \[0, NNODES=2\)"):
    distributed.plan(cfg(tmp_path, "p"), {"JAX_COORDINATOR_ADDRESS": "h0", "NNODES": "2", "NODE_RANK": "2"})


def test_cudnn_attention_is_accepted_and_says_it_needs_a_gpu(tmp_path):
  c = cfg(tmp_path, "cudnn", "attention=cudnn_flash_te", "steps=1", "per_device_batch_size=1")
  with pytest.raises(ConfigError, match="needs NVIDIA GPUs"):
    train.run(c)


@pytest.mark.gpu
def test_cudnn_attention_matches_dot_product_on_gpu(tmp_path):
  common = ["steps=3", "per_device_batch_size=1", "dtype=bfloat16"]
  ref = cfg(tmp_path, "dot", *common, "attention=dot_product")
  fused = cfg(tmp_path, "fused", *common, "attention=cudnn_flash_te")
  train.run(ref)
  train.run(fused)
  losses = lambda c: [r["loss"] for r in records(c.metrics_file)]
  np.testing.assert_allclose(losses(fused), losses(ref), rtol=2e-2)
