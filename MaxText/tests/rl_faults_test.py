"""GRPO (python3 -m MaxText.rl, the alias of objective=grpo) under SIGTERM, as a real process: it checkpoints the
step it is at and exits 75 with one line; a restart continues as the uninterrupted run would (docs/rl.md,
docs/failures.md)."""

import json
import sys

import jax
import numpy as np
import pytest

from MaxText import checkpointing, train
from MaxText.tests.conftest import cpu_subprocess_env
from MaxText.tests.helpers import Process, records, rl_args, rl_config, terminate_after

RUN = ["per_device_batch_size=4", "enable_checkpointing=true", "checkpoint_period=1000"]  # 2 devices: 2 prompts x 4


@pytest.mark.slow  # a subprocess and two in-process runs, each compiling the sampler and the update
def test_sigterm_checkpoints_the_current_step_exits_75_and_resumes_exactly(tmp_path):
  env = cpu_subprocess_env(2)  # the signal comes after step 2, not during the compile: the cache may serve it
  run = Process([sys.executable, "-u", "-m", "MaxText.rl", *rl_args(tmp_path, "term", *RUN, "steps=1000")], env)
  step = terminate_after(run, "step 2/1000")
  resumed = rl_config(tmp_path, "term", *RUN, f"steps={step + 1}")
  assert 2 <= step < 1000 and checkpointing.committed_steps(resumed.checkpoint_dir) == [step]

  two = jax.devices()[:2]
  train.run(resumed, devices=two)
  # The resume keeps the 1000-step learning-rate schedule the run started with (train.keep_schedule_on_resume).
  whole = rl_config(tmp_path, "whole", *RUN, f"steps={step + 1}", "learning_rate_schedule_steps=1000")
  train.run(whole, devices=two)
  keys = ("loss", "reward_mean", "kl", "grad_norm", "completion_length")
  got, want = records(resumed), records(whole)
  assert [r["step"] for r in got] == list(range(1, step + 2))  # the subprocess's steps, then the resumed one
  for r, w in zip(got, want, strict=True):
    np.testing.assert_allclose([r[k] for k in keys], [w[k] for k in keys], rtol=1e-5, err_msg=json.dumps(r))
