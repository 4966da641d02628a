"""Elastic resume (MaxText/elastic.py): a checkpoint of N devices resumes on M != N with the same global batch,
the same data and a loss curve that continues the uninterrupted run's."""

import json
import sys

import jax
import numpy as np
import pytest

from MaxText import elastic, train
from MaxText.errors import ConfigError
from MaxText.tests.conftest import BASE, ROOT, TINY, cfg, losses, run_processes

# Global batch 16 (2 per device on 8), a 12-step schedule whatever `steps` a leg stops at, a checkpoint every 4.
RUN = ["per_device_batch_size=2", "enable_checkpointing=true", "checkpoint_period=4", "async_checkpointing=false"]
RUN += ["learning_rate_schedule_steps=12"]


def leg(tmp_path, name, steps, devices, *overrides):
  return train.run(cfg(tmp_path, name, *RUN, f"steps={steps}", *overrides), devices=jax.devices()[:devices])


def processes_leg(tmp_path, name, steps):
  """train.py as two processes of 4 CPU devices each (jax.distributed on 127.0.0.1); returns process 0's log."""
  command = [sys.executable, "MaxText/train.py", BASE, f"run_name={name}", f"base_output_directory={tmp_path}"]
  results = run_processes([*command, *TINY, *RUN, f"steps={steps}"], ROOT, tmp_path, f"{name}{steps}", 2, 4)
  for rc, log in results:
    assert rc == 0, log[-3000:]
  return results[0][1]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  """The per-step losses of the uninterrupted 12-step run on 8 devices."""
  tmp_path = tmp_path_factory.mktemp("whole")
  leg(tmp_path, "whole", 12, 8)
  return losses(cfg(tmp_path, "whole"))


@pytest.mark.slow  # over 40 s on 2 busy cores (2026-11-27)
def test_8_to_4_to_8_devices_keeps_the_global_batch_and_the_loss_curve(tmp_path, capsys, corpus):
  glob, model = corpus  # the default pipeline (dataset_type=text) on the test corpus: packed documents
  text = ["dataset_type=text", f"dataset_path={glob}", f"tokenizer_path={model}", "vocab_size=512"]
  text += ["eval_fraction=0"]
  leg(tmp_path, "whole", 12, 8, *text)
  whole = losses(cfg(tmp_path, "whole"))
  leg(tmp_path, "elastic", 4, 8, *text)
  assert leg(tmp_path, "elastic", 8, 4, *text)["steps_run"] == 4
  out = capsys.readouterr().out
  line = "resuming on 4 devices (was 8): per_device_batch_size 2 -> 4, gradient_accumulation_steps 1 -> 2 to keep"
  assert f"{line} the global batch 16" in out
  assert leg(tmp_path, "elastic", 12, 8, *text)["steps_run"] == 4
  assert "resuming on 8 devices (was 4) with the same global batch 16" in capsys.readouterr().out
  # The 4-device leg sums two micro-batches: another reduction order, float32 noise only.
  np.testing.assert_allclose(losses(cfg(tmp_path, "elastic")), whole, rtol=1e-5)
  meta = json.loads((tmp_path / "elastic" / "checkpoints" / "8" / elastic.STEP_METADATA_FILE).read_text())
  assert meta["custom_metadata"][elastic.METADATA_KEY] == {
    "global_batch": 16, "devices": 4, "processes": 1, "per_device_batch_size": 4.0, "gradient_accumulation_steps": 2
  }  # fmt: skip


@pytest.mark.slow
def test_2_processes_to_1_to_2_keeps_the_global_batch_and_the_loss_curve(tmp_path, capsys, whole):
  processes_leg(tmp_path, "elastic", 4)
  assert leg(tmp_path, "elastic", 8, 4)["steps_run"] == 4  # one process, 4 devices
  assert "resuming on 4 devices (was 8): per_device_batch_size 2 -> 4" in capsys.readouterr().out
  log = processes_leg(tmp_path, "elastic", 12)
  assert "resuming on 8 devices (was 4) with the same global batch 16" in log
  np.testing.assert_allclose(losses(cfg(tmp_path, "elastic")), whole, rtol=1e-5)


def test_a_global_batch_that_cannot_be_kept_stops_with_one_line(tmp_path):
  # A checkpoint of global batch 12 on 4 devices (its step metadata only: the error comes before any restore).
  step = tmp_path / "twelve" / "checkpoints" / "3"
  step.mkdir(parents=True)
  layout = elastic.Layout(12, 4, 1, 3.0, 1)._asdict()
  (step / elastic.STEP_METADATA_FILE).write_text(json.dumps({"custom_metadata": {elastic.METADATA_KEY: layout}}))
  with pytest.raises(ConfigError) as error:
    leg(tmp_path, "twelve", 4, 8, "per_device_batch_size=3")
  assert str(error.value) == (
    "cannot keep the global batch 12 of the checkpoint (saved on 4 devices) on 8 devices: 12 rows do not split "
    "over the 8 batch shards of this mesh; resume on a device count that divides 12 (e.g. 6 or 12), or set "
    "elastic_resume=false and per_device_batch_size (with gradient_accumulation_steps) to train on with another "
    "global batch"
  )
  assert elastic.saved_layout(str(tmp_path / "twelve" / "checkpoints")) == elastic.Layout(**layout)


@pytest.mark.parametrize(
  "saved, devices, expected",
  [
    (elastic.Layout(32, 8, 1, 4.0, 1), 4, (8.0, 2)),  # the rows per device and micro-batch stay 4
    (elastic.Layout(32, 4, 1, 8.0, 2), 8, (4.0, 1)),  # more devices: fewer micro-batches
    (elastic.Layout(12, 4, 1, 3.0, 1), 6, (2.0, 1)),
    (elastic.Layout(24, 8, 1, 3.0, 1), 6, (4.0, 2)),  # 4 rows split in 2 micro-batches of 2 (<= 3)
    # A restart on the 4 devices an elastic resume left, with the first run's command line: still 16.
    (elastic.Layout(16, 4, 1, 4.0, 2), 4, (4.0, 2)),
  ],
)
def test_per_device_batch_and_accumulation(tmp_path, saved, devices, expected):
  config = cfg(tmp_path, "unit", "per_device_batch_size=1")
  mesh = train.sharding.create_mesh(config, jax.devices()[:devices])
  kept, note = elastic.keep_global_batch(config, mesh, saved)
  assert (kept.per_device_batch_size, kept.gradient_accumulation_steps) == expected
  was = f" (was {saved.devices})" if saved.devices != devices else ""
  assert note.startswith(f"resuming on {devices} devices{was}: per_device_batch_size 1 -> {expected[0]:g}")
  off = config.replace(elastic_resume=False)
  assert elastic.keep_global_batch(off, mesh, saved) == (off, None)
