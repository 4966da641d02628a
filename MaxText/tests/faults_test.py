"""Signals, preemption and lost processes with real processes (train.py on 127.0.0.1, CPU devices): the
first signal checkpoints at the next step boundary and exits 75 with one line, a second exits at once
(128 + signal), every process of a job stops at the same step, and a lost process makes the others exit
76 with one line. See docs/failures.md."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from MaxText import distributed, preemption, train
from MaxText.errors import DataError
from MaxText.tests.conftest import ROOT, cfg, free_port
from MaxText.tests.helpers import (
  FAULTS_RUN,
  Process,
  assert_clean,
  checkpoints,
  start,
  stopped_line,
  stopped_step,
  terminate_after,
  train_command,
)


@pytest.mark.slow
def test_sigterm_during_async_saves_checkpoints_that_step_and_resumes(tmp_path):
  # checkpoint_period=1 with async saves: a save is in flight whenever the signal lands.
  step = terminate_after(start(tmp_path, "term", "checkpoint_period=1", "async_checkpointing=true"), "step 3/")
  assert 4 <= step < 200 and checkpoints(tmp_path, "term")[-1] == step

  # Resumed here on 8 devices (the run had 2): a global batch of 8 on purpose, so elastic_resume=false.
  resumed = cfg(tmp_path, "term", *FAULTS_RUN[:3], f"steps={step + 2}", "checkpoint_period=100", "elastic_resume=false")
  assert train.run(resumed)["steps_run"] == 2
  with open(resumed.metrics_file) as f:
    logged = [json.loads(line)["step"] for line in f]
  assert logged[-2:] == [step + 1, step + 2] and checkpoints(tmp_path, "term")[-1] == step + 2


@pytest.mark.slow
def test_sigint_during_compile_checkpoints_step_one(tmp_path):
  run = start(tmp_path, "int", "checkpoint_period=100", compile_cache=False)  # a real compile to interrupt
  run.wait_for("  outputs  ")  # the header's last line, printed just before the first step compiles
  run.proc.send_signal(signal.SIGINT)
  rc, output = run.finish()
  assert rc == preemption.EXIT_STOPPED, output[-3000:]
  assert_clean(output)
  assert stopped_line(output).startswith("Stopped at step 1: SIGINT received; checkpoint saved to")
  assert checkpoints(tmp_path, "int") == [1]


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path):
  run = start(tmp_path, "twice", "checkpoint_period=100", compile_cache=False)  # signals mid-compile
  run.wait_for("  outputs  ")
  run.proc.send_signal(signal.SIGTERM)
  run.wait_for("SIGTERM received: stopping at the next step boundary")  # the listener thread: even mid-compile
  sent = time.monotonic()
  run.proc.send_signal(signal.SIGTERM)
  rc, output = run.finish()
  assert rc == 128 + signal.SIGTERM and time.monotonic() - sent < 10, output[-3000:]
  assert "exiting at once with status 143" in output and "Stopped at step" not in output
  assert_clean(output)


def test_signal_before_training_exits_at_once_with_one_line():
  code = (
    "from MaxText import preemption; import time; preemption.install_startup_handlers(); print('up'); time.sleep(60)"
  )
  proc = Process([sys.executable, "-u", "-c", code], {**os.environ, "JAX_PLATFORMS": "cpu"})
  proc.wait_for("up")
  proc.proc.send_signal(signal.SIGINT)
  rc, output = proc.finish(timeout=30)
  assert rc == 128 + signal.SIGINT and "SIGINT received outside the training loop" in output
  assert_clean(output)


def test_watch_sees_a_signal_and_gives_the_handlers_back(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  with preemption.Watch(jax.sharding.Mesh(jax.devices(), ("all",))) as watch:
    assert watch.stop_signal() == 0
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not watch.signum and time.monotonic() < deadline:
      time.sleep(0.01)
    assert watch.stop_signal() == signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) is before


def test_latest_checkpoint_ignores_unfinished_saves(tmp_path):
  for name in ("3", "12", "20.orbax-checkpoint-tmp-1", "notes"):
    os.makedirs(tmp_path / name)
  assert preemption.latest_checkpoint(str(tmp_path)) == 12
  assert preemption.latest_checkpoint(str(tmp_path / "missing")) is None


def two_processes(tmp_path, name, *overrides):
  port, common = free_port(), ["dcn_data_parallelism=2", "ici_fsdp_parallelism=-1", *overrides]
  return [start(tmp_path, name, *common, rank=rank, port=port) for rank in range(2)]


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
  runs = two_processes(tmp_path, "pair", "checkpoint_period=100", "async_checkpointing=false")
  runs[0].wait_for("step 3/")  # process 0 writes the metrics
  runs[1].proc.send_signal(signal.SIGTERM)
  results = [run.finish() for run in runs]
  for rc, output in results:
    assert rc == preemption.EXIT_STOPPED, output[-3000:]
    assert_clean(output)
  steps = [stopped_step(output) for _, output in results]
  assert steps[0] == steps[1] and checkpoints(tmp_path, "pair") == [steps[0]]
  assert "SIGTERM received by another process" in stopped_line(results[0][1])
  assert "SIGTERM received;" in stopped_line(results[1][1])


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_process_makes_the_survivor_exit_76_naming_it_and_keeps_the_checkpoint(tmp_path, victim):
  # The kill follows the save of checkpoint 3 at once. Process 1 killed: the survivor's gloo collective waits
  # for it, and the lost-process watch ends it once the coordinator has missed its heartbeats (3 s here).
  # Process 0 (the coordinator) killed: the survivor's collective fails at once; so does JAX's error poll of the
  # coordinator, which aborts the process (no Python runs) when it comes first, as it can on a loaded machine
  # (docs/failures.md). Either way the survivor stops at once and the last checkpoint stays whole.
  runs = two_processes(
    tmp_path, "lost", "checkpoint_period=3", "async_checkpointing=false", "jax_distributed_heartbeat_timeout=3"
  )
  runs[0].wait_for("checkpoint saved")
  runs[victim].proc.kill()
  killed = time.monotonic()
  rc, output = runs[1 - victim].finish(timeout=60)
  assert time.monotonic() - killed < 3 + 15, output[-3000:]
  if victim == 0 and rc == -signal.SIGABRT:
    assert "Terminating process because the JAX distributed service detected fatal errors" in output, output[-3000:]
    assert preemption.latest_checkpoint(f"{tmp_path}/lost/checkpoints") >= 3
    return
  assert rc == preemption.EXIT_PROCESS_LOST, output[-3000:]
  assert_clean(output)
  lines = [line for line in output.splitlines() if line.startswith("Lost ")]
  assert len(lines) == 1, output[-3000:]
  assert lines[0].startswith(f"Lost process {victim} of this 2-process job") and "resumes from checkpoint" in lines[0]
  last = preemption.latest_checkpoint(f"{tmp_path}/lost/checkpoints")
  assert last >= 3 and f"resumes from checkpoint {last} " in lines[0]
  if victim == 0:
    return
  # That checkpoint restores (one process, the same 4 devices) and training goes on from it.
  resumed = cfg(
    tmp_path, "lost", *FAULTS_RUN[:3], f"steps={last + 1}", "dcn_data_parallelism=1", "ici_fsdp_parallelism=4"
  )
  assert train.run(resumed, devices=jax.devices()[:4])["steps_run"] == 1


def test_collective_failures_count_as_lost_processes_and_user_errors_do_not():
  gloo = "UNKNOWN: Gloo all-reduce failed: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:1"
  assert preemption._peer_lost(ValueError(gloo))  # how a jitted call reports the previous call's failure
  assert preemption._peer_lost(jax.errors.JaxRuntimeError(gloo))
  assert not preemption._peer_lost(DataError("gs://b/data: connection refused by the storage emulator"))
  assert not preemption._peer_lost(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"))
  failed = (ValueError, ValueError(gloo), None)
  record = logging.LogRecord("absl", logging.ERROR, __file__, 1, "save failed", None, failed)
  assert preemption._PEER_LOST_FILTER.filter(record) and record.exc_info is None  # the message, no traceback


def test_lone_coordinator_exits_with_its_own_message(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}"}
  env.update(NNODES="2", NODE_RANK="0")
  command = [*train_command(tmp_path, "alone"), "jax_distributed_initialization_timeout=2"]
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1, result.stderr[-3000:]
  assert "did not all join within 2 s (process 0 of 2" in result.stderr
  assert_clean(result.stderr)


def test_initialize_applies_the_configured_timeouts(tmp_path, monkeypatch):
  seen = {}
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: seen.update(kwargs))
  monkeypatch.setattr(jax.config, "update", lambda *args: None)  # no gloo switch in this test process
  monkeypatch.setattr(distributed, "wait_for_coordinator", lambda *args: None)
  c = cfg(tmp_path, "t", "jax_distributed_heartbeat_timeout=7", "jax_distributed_initialization_timeout=20")
  distributed.initialize(c, {"JAX_COORDINATOR_ADDRESS": "h0:1", "NNODES": "2", "NODE_RANK": "1"})
  assert seen["heartbeat_timeout_seconds"] == 7 and seen["shutdown_timeout_seconds"] == 7
  assert seen["initialization_timeout"] == 20 + distributed.ABORT_MARGIN_S  # ours fires first, with one line
