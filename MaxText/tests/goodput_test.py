"""MaxText/goodput.py: one clock charges every second of a run to one kind; the record accumulates over the
attempts of a run in <run dir>/goodput.json and counts the steps an attempt redid after an earlier one was lost."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from MaxText import goodput, train
from MaxText.errors import ConfigError
from MaxText.tests.conftest import cfg
from MaxText.tests.helpers import checkpoints, start

pytestmark = pytest.mark.usefixtures("no_compile_cache")  # these tests count compilations: no cache hits

CKPT = ["enable_checkpointing=true", "async_checkpointing=false"]


def record(c):
  with open(os.path.join(c.run_dir, goodput.RECORD_FILE)) as f:
    return json.load(f)


def assert_adds_up(rec, tolerance_s=0.5):
  """Every kind is there and the kinds add up to the wall time (the clock leaves no gap)."""
  assert set(rec["seconds"]) == set(goodput.KINDS)
  assert all(v >= 0 for v in rec["seconds"].values())
  assert abs(sum(rec["seconds"].values()) - rec["total_s"]) < tolerance_s, rec


def train_records(c):
  with open(c.metrics_file) as f:
    return [r for r in map(json.loads, f) if "loss" in r]


def test_clock_charges_phases_and_takes_compilation_out(tmp_path):
  c = cfg(tmp_path, "clock")
  clock = goodput.Recorder(c, time.perf_counter(), is_writer=True)
  with clock.phase("data_wait"):
    time.sleep(0.05)
  jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.123)(jnp.ones(7))  # a fresh compile, charged at the next step
  clock.step(1)
  with clock.phase("eval"):
    time.sleep(0.02)
  s = clock.seconds
  assert s["data_wait"] >= 0.05 and s["eval"] >= 0.02 and s["compile"] > 0 and s["startup"] >= 0
  assert clock.steps == {"productive": 1, "redone": 0}
  rec = clock.close()
  assert rec["attempts"] == 1 and rec["max_step"] == 1 and record(c) == rec
  assert_adds_up(rec, tolerance_s=0.01)


def test_record_accumulates_over_attempts_and_counts_redone_steps(tmp_path):
  c = cfg(tmp_path, "acc")
  first = goodput.Recorder(c, time.perf_counter(), is_writer=True)
  for done in (1, 2, 3, 4):
    first.step(done)
  first.close()
  second = goodput.Recorder(c, time.perf_counter(), is_writer=True)  # resumed from checkpoint 2
  for done in (3, 3, 4, 5):  # a step is counted once however often its time is charged
    second.step(done)
  rec = second.close()
  assert rec["attempts"] == 2 and rec["max_step"] == 5
  assert rec["steps"] == {"productive": 5, "redone": 2}
  fields = goodput.fractions(rec)
  assert fields["goodput_redone_steps"] == 2 and fields["goodput_attempts"] == 2
  shares = [fields["goodput"], *(fields[f"badput_{k}"] for k in goodput.BADPUT)]
  assert 0 <= fields["goodput"] <= 1 and abs(sum(shares) - 1) < 1e-6


def test_unreadable_record_starts_again_and_disabled_writes_nothing(tmp_path):
  c = cfg(tmp_path, "bad")
  os.makedirs(c.run_dir)
  with open(os.path.join(c.run_dir, goodput.RECORD_FILE), "w") as f:
    f.write('{"version": 1, "total_s": ')  # what a torn write would leave (writes are atomic: never ours)
  assert goodput.Recorder(c, time.perf_counter(), is_writer=True).prior == goodput.empty_record()
  off = cfg(tmp_path, "off", "enable_goodput_recording=false")
  clock = goodput.Recorder(off, time.perf_counter(), is_writer=True)
  clock.step(1)
  assert clock.figures() == {} and clock.close() == {}
  assert not os.path.exists(os.path.join(off.run_dir, goodput.RECORD_FILE))


def test_a_damaged_record_continues_from_the_newest_checkpoints_copy(tmp_path, caplog, monkeypatch):
  # launch.setup_logging (run by an earlier test in this process) stops MaxText.* from reaching caplog's handler.
  monkeypatch.setattr(logging.getLogger("MaxText"), "propagate", True)
  c = cfg(tmp_path, "copy", *CKPT)
  kept = goodput.empty_record() | {"attempts": 2, "total_s": 30.0, "max_step": 4}
  for step, rec in ((2, goodput.empty_record()), (4, kept), (6, None)):  # 6: written before copies were kept
    os.makedirs(os.path.join(c.checkpoint_dir, str(step)))
    meta = {"custom_metadata": {"layout": {}} | ({goodput.METADATA_KEY: rec} if rec else {})}
    with open(os.path.join(c.checkpoint_dir, str(step), goodput.STEP_METADATA_FILE), "w") as f:
      json.dump(meta, f)
  path = os.path.join(c.run_dir, goodput.RECORD_FILE)
  for damage in ("{not json", '["a list"]'):
    with open(path, "w") as f:
      f.write(damage)
    caplog.clear()
    prior = goodput.Recorder(c, time.perf_counter(), is_writer=True).prior
    assert (prior["attempts"], prior["total_s"], prior["max_step"]) == (2, 30.0, 4)
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert line.startswith(f"{path} is damaged (") and line.endswith("the history continues from checkpoint 4's copy")
  without = cfg(tmp_path, "nocopy", "enable_checkpointing=false")
  os.makedirs(without.run_dir)
  with open(os.path.join(without.run_dir, goodput.RECORD_FILE), "w") as f:
    f.write("\x00\x00")
  caplog.clear()
  assert goodput.Recorder(without, time.perf_counter(), is_writer=True).prior == goodput.empty_record()
  assert [r.getMessage() for r in caplog.records][-1].endswith("the goodput figures start again")


def test_a_directory_in_place_of_the_record_is_one_line(tmp_path):
  c = cfg(tmp_path, "dir")
  os.makedirs(os.path.join(c.run_dir, goodput.RECORD_FILE))
  with pytest.raises(ConfigError, match=r"goodput.json' is a directory where the run's goodput record .* remove it$"):
    goodput.Recorder(c, time.perf_counter(), is_writer=True)


def test_the_clock_starts_with_the_program_not_with_the_shell_that_execs_it():
  """`bash -c 'sleep 3; exec python3 ...'` is one process: its first 3 s (pip, in setup.sh && train.py) are not
  the program's."""
  script = "import time; from MaxText import goodput; print(time.perf_counter() - goodput.program_start())"
  out = subprocess.run(
    ["bash", "-c", f'sleep 3; exec "{sys.executable}" -c "{script}"'], capture_output=True, text=True, check=True
  ).stdout
  assert 0 <= float(out) < 2.5


def test_run_records_every_kind_and_a_resume_past_a_lost_checkpoint_counts_redone_steps(tmp_path, capsys):
  c = cfg(tmp_path, "run", *CKPT, "steps=6", "checkpoint_period=2")
  summary = train.run(c, devices=jax.devices()[:1])  # one device: the quickest compile
  rec = record(c)
  assert_adds_up(rec)
  s = rec["seconds"]
  assert s["productive"] > 0 and s["compile"] > 0 and s["startup"] > 0 and s["checkpoint_save"] > 0
  assert rec["steps"] == {"productive": 6, "redone": 0} and rec["max_step"] == 6 and rec["attempts"] == 1
  copy, step = goodput.checkpoint_copy(c.checkpoint_dir)  # each checkpoint keeps the record as it was then
  assert step == 6 and copy["steps"]["productive"] == 6 and copy["total_s"] <= rec["total_s"]
  assert 0 < summary["goodput"] <= 1 and summary["badput_redone"] == 0
  last = train_records(c)[-1]
  assert {"goodput", *(f"badput_{k}" for k in goodput.BADPUT)} <= set(last) and 0 < last["goodput"] <= 1
  out = capsys.readouterr().out
  assert "  goodput              " in out and "  badput               " in out
  assert "badput_" not in out  # the console shows the summary lines only

  # Checkpoint 6 lost (as if the process died after step 6, before that save): the rerun resumes from 4 and
  # steps 5 and 6 are done again.
  shutil.rmtree(os.path.join(c.checkpoint_dir, "6"))
  summary = train.run(c, devices=jax.devices()[:1])  # one device: the quickest compile
  rec = record(c)
  assert_adds_up(rec)
  assert rec["attempts"] == 2 and rec["steps"] == {"productive": 6, "redone": 2}
  assert rec["seconds"]["redone"] > 0 and rec["seconds"]["checkpoint_restore"] > 0
  assert summary["goodput_redone_steps"] == 2 and summary["badput_redone"] > 0


@pytest.mark.slow
def test_killed_run_resumed_reports_the_redone_steps_as_badput(tmp_path):
  # kill -9 after step 7 completed: the last checkpoint is 5 (the next is 10), the record knows step >= 7.
  run = start(tmp_path, "kill9", "checkpoint_period=5", "async_checkpointing=false", "log_period=1")
  run.wait_for("step 7/")
  run.proc.send_signal(signal.SIGKILL)
  run.finish()
  c = cfg(tmp_path, "kill9", *CKPT, "per_device_batch_size=1", "hardware=cpu", "log_period=1")
  reached, last = record(c)["max_step"], checkpoints(tmp_path, "kill9")[-1]
  assert reached >= 7 and last < reached, (reached, last)
  resumed = cfg(tmp_path, "kill9", *CKPT, "per_device_batch_size=1", "hardware=cpu", f"steps={reached + 1}")
  summary = train.run(resumed, devices=jax.devices()[:2])  # the killed run's 2 devices
  rec = record(resumed)
  assert rec["attempts"] == 2 and rec["steps"]["redone"] == reached - last > 0 and rec["seconds"]["redone"] > 0
  assert summary["goodput_redone_steps"] == reached - last and summary["badput_redone"] > 0
  # The killed attempt's time up to its last record plus the whole resumed attempt, all charged.
  assert_adds_up(rec)
