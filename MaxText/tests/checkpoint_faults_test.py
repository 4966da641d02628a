"""Checkpoint faults: a resume falls back past unreadable steps (truncated, zeroed or deleted array files,
garbage metadata, a missing item, an empty step directory), moving them aside with one line each; a
model change fails with one line and moves nothing; a step directory given as load_*_path is named; a
full disk removes the partial save and ends in one line; an async save commits within
async_checkpoint_max_lag_steps, so a kill loses at most checkpoint_period + that many steps."""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from MaxText import checkpointing, objectives, optimizers, sharding, train
from MaxText import state as state_lib
from MaxText.errors import CheckpointError, ConfigError, DataError
from MaxText.tests.conftest import BASE, ROOT, TINY, cfg, cpu_subprocess_env

COMMON = ["per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=2", "steps=4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A run directory with checkpoints 2 and 4, written asynchronously."""
  root = tmp_path_factory.mktemp("trained")
  train.run(cfg(root, "r", *COMMON, "async_checkpointing=true"))
  return root


def _copy(trained, tmp_path):
  shutil.copytree(trained / "r", tmp_path / "r")
  return cfg(tmp_path, "r", *COMMON)


def _restore(c, with_data=False):
  """restore_or_init as train.run calls it; with_data: the data source takes the iterator state, as in a run."""
  tx = optimizers.build(c).tx
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    manager = checkpointing.create_manager(c)
    accept = objectives.get(c).sources(c, mesh).train.set_state if with_data else None
    try:
      return checkpointing.restore_or_init(c, tx, spec, manager, accept)
    finally:
      if manager is not None:
        manager.close()


def _array_files(step_dir):
  found = []
  for dirpath, _, names in os.walk(os.path.join(step_dir, "state")):
    if os.path.basename(dirpath) == "d":  # tensorstore's data files (ocdbt and its process subdirectories)
      found += [os.path.join(dirpath, n) for n in names]
  assert found
  return found


def _truncate(step_dir):
  for f in _array_files(step_dir):
    os.truncate(f, 10)


def _zero(step_dir):
  for f in _array_files(step_dir):
    size = os.path.getsize(f)
    with open(f, "wb") as out:
      out.write(b"\0" * size)


def _delete(step_dir):
  for f in _array_files(step_dir):
    os.remove(f)


def _garbage_metadata(step_dir):
  with open(os.path.join(step_dir, "state", "_METADATA"), "w") as f:
    f.write("{not json")


def _data_state(step_dir, text):
  with open(os.path.join(step_dir, "data", "metadata"), "w") as f:
    f.write(text)


CORRUPTIONS = {
  "truncated": _truncate,
  "zeroed": _zero,
  "deleted": _delete,
  "garbage_metadata": _garbage_metadata,
  "no_state": lambda d: shutil.rmtree(os.path.join(d, "state")),
  "no_data": lambda d: shutil.rmtree(os.path.join(d, "data")),
  "data_garbage": lambda d: _data_state(d, "{not json"),
  "data_other_json": lambda d: _data_state(d, '{"rows": [1, 2]}'),
  "data_other_position": lambda d: _data_state(d, '{"step": 7}'),  # well formed: only its checksum tells
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_unreadable_latest_step_is_moved_aside_and_the_previous_one_resumes(trained, tmp_path, capsys, name):
  c = _copy(trained, tmp_path)
  CORRUPTIONS[name](os.path.join(c.checkpoint_dir, "4"))
  restored = _restore(c)
  assert restored.source == "resume from step 2" and int(restored.state.step) == 2
  assert restored.data_state is not None
  out = capsys.readouterr().out
  assert "checkpoint step 4 cannot be restored: " in out
  assert f"moved unreadable checkpoint step 4 to {c.run_dir}/checkpoints_unreadable/4; resuming from step 2" in out
  assert sorted(os.listdir(c.checkpoint_dir)) == ["2"]
  assert os.listdir(os.path.join(c.run_dir, checkpointing.UNREADABLE_DIR)) == ["4"]  # kept, not deleted


@pytest.mark.parametrize("text", ['{"rows": [1, 2]}', '{"step": -1}', '["step"]', '{"step": "4"}'])
def test_a_malformed_data_state_without_checksums_falls_back(trained, tmp_path, capsys, text):
  # Written before checksums: the data source itself refuses a state it never writes, as damage.
  c = _copy(trained, tmp_path)
  for step in ("2", "4"):
    shutil.rmtree(os.path.join(c.checkpoint_dir, step, "checksums"))
  _data_state(os.path.join(c.checkpoint_dir, "4"), text)
  assert _restore(c, with_data=True).source == "resume from step 2"
  out = capsys.readouterr().out
  assert "checkpoint step 4 cannot be restored: ValueError: data iterator state" in out and "damaged" in out
  assert os.listdir(os.path.join(c.run_dir, checkpointing.UNREADABLE_DIR)) == ["4"]


def test_a_data_state_of_other_data_is_the_users_change_and_moves_nothing(tmp_path, corpus):
  # An intact state (its checksum matches) that does not fit this run's corpus: the one-line DataError, as before.
  glob, model = corpus
  text = ["dataset_type=text", f"tokenizer_path={model}", "vocab_size=512", "eval_fraction=0", *COMMON, "steps=2"]
  first = cfg(tmp_path, "d", *text, f"dataset_path={glob}")
  train.run(first)
  other = tmp_path / "other"
  other.mkdir()
  (other / "a.txt").write_text("a different corpus " * 200)
  changed = cfg(tmp_path, "d", *text, f"dataset_path={other}/*.txt")
  with pytest.raises(DataError, match="rows per epoch"):
    _restore(changed, with_data=True)
  assert os.listdir(first.checkpoint_dir) == ["2"] and not os.path.exists(
    os.path.join(first.run_dir, checkpointing.UNREADABLE_DIR)
  )


def test_empty_newer_step_directory_is_moved_aside(trained, tmp_path, capsys):
  c = _copy(trained, tmp_path)
  os.makedirs(os.path.join(c.checkpoint_dir, "6"))
  assert _restore(c).source == "resume from step 4"
  assert "checkpoint step 6 cannot be restored" in capsys.readouterr().out
  assert sorted(os.listdir(c.checkpoint_dir)) == ["2", "4"]


def test_changed_model_fails_in_one_line_and_moves_nothing(trained, tmp_path):
  _copy(trained, tmp_path)
  c = cfg(tmp_path, "r", *COMMON, "base_mlp_dim=96")
  with pytest.raises(CheckpointError, match=r"newest, step 4: .*use a new run_name") as e:
    _restore(c)
  assert "\n" not in str(e.value)
  assert sorted(os.listdir(c.checkpoint_dir)) == ["2", "4"]


@pytest.mark.parametrize("key", ["load_parameters_path", "load_full_state_path"])
def test_step_directory_as_load_path_names_its_state_item(trained, tmp_path, key):
  step_dir = os.path.join(trained, "r", "checkpoints", "4")
  c = cfg(tmp_path, "fresh", "per_device_batch_size=1", f"{key}={step_dir}")
  with pytest.raises(ConfigError, match=f"is a checkpoint step directory; set {key}={step_dir}/state"):
    _restore(c)


@pytest.mark.parametrize("key", ["load_parameters_path", "load_full_state_path"])
def test_loading_a_state_item_directory_logs_no_missing_step_metadata(trained, tmp_path, caplog, key):
  # orbax looks for the step's _CHECKPOINT_METADATA inside the item directory, where it never is
  state_dir = os.path.join(trained, "r", "checkpoints", "4", "state")
  c = cfg(tmp_path, "fresh", "per_device_batch_size=1", f"{key}={state_dir}")
  with caplog.at_level(logging.WARNING, logger="absl"):
    assert int(_restore(c).state.step) == (4 if key == "load_full_state_path" else 0)
  assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]
  assert not any(isinstance(f, checkpointing._NoStepMetadataNotice) for f in logging.getLogger("absl").filters)


NO_SPACE = "RESOURCE_EXHAUSTED: Error writing \"a/0\": No space left on device [os_error_code='28']"


def test_disk_full_removes_the_partial_save_and_says_so(trained, tmp_path, monkeypatch):
  # Injected: the save of step 6 fails the way tensorstore reports ENOSPC, after orbax created its
  # temporary directory (the tmpfs test below does it for real where mounting is allowed).
  c = _copy(trained, tmp_path)
  manager = checkpointing.create_manager(c)
  real_save = manager.save

  def full_disk(step, *args, **kwargs):
    if step == 6:
      os.makedirs(os.path.join(c.checkpoint_dir, f"6{checkpointing.TMP_SUFFIX}", "state"))
      raise ValueError(NO_SPACE)
    return real_save(step, *args, **kwargs)

  monkeypatch.setattr(manager, "save", full_disk)
  with pytest.raises(CheckpointError, match="no space left on .*step 4 is the last complete") as e:
    checkpointing.save(manager, 6, {"x": 1}, {})
  manager.close()
  assert f"6{checkpointing.TMP_SUFFIX}" in str(e.value)
  assert sorted(os.listdir(c.checkpoint_dir)) == ["2", "4"]
  assert checkpointing._no_space(OSError(errno.ENOSPC, "No space left on device"))


def _mount_tmpfs(path, size):
  os.makedirs(path)
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
  if result.returncode != 0:
    pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); the injected disk-full test covers the logic")


@pytest.mark.slow
def test_disk_full_on_a_real_small_filesystem(trained, tmp_path):
  one = sum(
    os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(trained / "r" / "checkpoints" / "2") for f in fs
  )
  mount = str(tmp_path / "small")
  _mount_tmpfs(mount, int(1.5 * one) + 64 * 1024)  # room for the first checkpoint and the metrics, not a second
  try:
    args = [BASE, "run_name=d", f"base_output_directory={mount}", *TINY, *COMMON, "async_checkpointing=true"]
    command = [sys.executable, "MaxText/train.py", *args]
    result = subprocess.run(command, cwd=ROOT, env=cpu_subprocess_env(8), capture_output=True, text=True)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last.startswith("CheckpointError: no space left on "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-6000:]  # orbax's thread errors keep one line each
    assert sorted(os.listdir(os.path.join(mount, "d", "checkpoints"))) == ["2"]  # the partial save is gone
  finally:
    subprocess.run(["umount", mount], check=False)


@pytest.mark.slow
def test_kill_after_an_async_save_loses_at_most_period_plus_lag(tmp_path):
  period, lag = 5, 1
  args = [BASE, "run_name=k", f"base_output_directory={tmp_path}", *TINY, "per_device_batch_size=1", "steps=2000"]
  args += ["enable_checkpointing=true", f"checkpoint_period={period}", f"async_checkpoint_max_lag_steps={lag}"]
  metrics_file = os.path.join(tmp_path, "k", "metrics.jsonl")
  env = cpu_subprocess_env(8)
  proc = subprocess.Popen([sys.executable, "MaxText/train.py", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
  logged, deadline = -1, time.time() + 240
  while logged < 3 * period + lag and time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics_file):
      with open(metrics_file) as f:
        lines = [line for line in f if line.endswith("\n")]
      logged = json.loads(lines[-1])["step"] if lines else -1
    time.sleep(0.01)
  proc.kill()
  proc.wait()
  assert logged >= 3 * period + lag, "the run must be killed mid-way"
  # Step `logged` was read after its loop iteration, which waited for the save `lag` steps before it.
  committed = checkpointing.committed_steps(os.path.join(tmp_path, "k", "checkpoints"))
  assert committed and committed[-1] >= period * ((logged + 1 - lag) // period), (logged, committed)


def _flip_bit(path, fraction):
  """Flip one bit of the file at `path`, `fraction` of the way through it."""
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    at = min(int(len(data) * fraction), len(data) - 1)
    data[at] ^= 0x10
    f.seek(0)
    f.write(data)


@pytest.mark.parametrize("fraction", [0.1, 0.35, 0.6, 0.9])
def test_a_flipped_bit_in_the_array_data_falls_back_to_the_previous_step(trained, tmp_path, capsys, fraction):
  c = _copy(trained, tmp_path)
  largest = max(_array_files(os.path.join(c.checkpoint_dir, "4")), key=os.path.getsize)
  _flip_bit(largest, fraction)
  restored = _restore(c)
  assert restored.source == "resume from step 2" and int(restored.state.step) == 2
  out = capsys.readouterr().out
  assert "checkpoint step 4 cannot be restored: " in out  # a checksum mismatch, or the store's own error
  assert os.listdir(os.path.join(c.run_dir, checkpointing.UNREADABLE_DIR)) == ["4"]


def test_after_a_flipped_bit_the_run_resumes_with_an_undamaged_runs_losses(trained, tmp_path, capsys):
  c = _copy(trained, tmp_path)
  step_dir = os.path.join(c.checkpoint_dir, "4")
  _flip_bit(max(_array_files(step_dir), key=os.path.getsize), 0.5)
  with open(os.path.join(trained, "r", "metrics.jsonl")) as f:
    undamaged = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
  os.remove(c.metrics_file)
  train.run(cfg(tmp_path, "r", *COMMON))
  with open(c.metrics_file) as f:
    resumed = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
  assert sorted(resumed) == [3, 4] and all(resumed[s] == undamaged[s] for s in resumed)
  assert "does not match the checksum saved with it" in capsys.readouterr().out


def test_a_checkpoint_without_checksums_restores_and_says_so(trained, tmp_path, capsys):
  c = _copy(trained, tmp_path)
  shutil.rmtree(os.path.join(c.checkpoint_dir, "4", "checksums"))  # as written before they were recorded
  restored = _restore(c)
  assert restored.source == "resume from step 4"
  assert "checkpoint step 4 carries no checksums (written before they were recorded)" in capsys.readouterr().out


@pytest.mark.parametrize("key", ["load_parameters_path", "load_full_state_path"])
def test_a_damaged_checkpoint_given_by_path_is_one_error_naming_the_array(trained, tmp_path, key):
  c = _copy(trained, tmp_path)
  step_dir = os.path.join(c.checkpoint_dir, "4")
  before = checkpointing.checksums.saved(step_dir)
  assert before and all(len(v) == 16 for v in before.values())
  # load_parameters_path reads the params alone, and which data file holds them is up to the async writer:
  # damage every file, one bit in each 256 bytes, so a read of any array meets a flipped bit.
  for f in _array_files(step_dir):
    for i in range(0, os.path.getsize(f), 256):
      _flip_bit(f, i / os.path.getsize(f))
  fresh = cfg(tmp_path, "fresh", *COMMON, f"{key}={step_dir}/state")
  with pytest.raises((CheckpointError, ConfigError), match=r"damaged|cannot|checkpoint"):
    _restore(fresh)
