"""A run's saved config.yml given back as the config: to decode.py (the command the closing summary prints, run
as printed), to train.py (it resumes the run) and to train_compile.py."""

import contextlib
import io
import os
import shlex
import subprocess
import sys

import pytest

from MaxText import train, train_compile
from MaxText.tests.conftest import BASE, ROOT, TINY

pytestmark = pytest.mark.slow  # a training run, a decode process and two compiles: about a minute on 2 cores


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """(run directory, stdout) of a one-step tiny run with a checkpoint."""
  out = tmp_path_factory.mktemp("saved")
  argv = ["train.py", BASE, f"base_output_directory={out}", "run_name=r", *TINY, "steps=1", "enable_checkpointing=true"]
  stdout, cwd = io.StringIO(), os.getcwd()
  os.chdir(ROOT)  # where the quick start runs from: the command names MaxText/decode.py relative to it
  try:
    with contextlib.redirect_stdout(stdout):
      train.main(argv)
  finally:
    os.chdir(cwd)
  return str(out / "r"), stdout.getvalue()


def test_the_printed_decode_command_decodes_the_run(finished):
  run_dir, stdout = finished
  line = next(line for line in stdout.splitlines() if line.strip().startswith("generate:"))
  argv = shlex.split(line.split("generate:", 1)[1])
  assert argv[:3] == ["python3", "MaxText/decode.py", os.path.join(run_dir, "config.yml")]
  assert argv[-1] == "decode_sampling_strategy=nucleus"  # synthetic data: no words of its own, the config's prompt
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  real = subprocess.run([sys.executable, *argv[1:], "decode_max_new_tokens=2"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)  # fmt: skip
  assert real.returncode == 0, real.stderr[-3000:]
  assert f"Parameters: {run_dir}/checkpoints/1/state" in real.stdout and "Output: " in real.stdout


def test_train_resumes_the_run_from_its_saved_config(finished, tmp_path, monkeypatch, capsys):
  run_dir, _ = finished
  monkeypatch.chdir(tmp_path)  # the saved paths are absolute: any working directory
  train.main(["train.py", os.path.join(run_dir, "config.yml"), "steps=2"])
  assert "steps 1 -> 2 | start: resume from step 1" in capsys.readouterr().out


def test_train_compile_takes_the_saved_config(finished, capsys):
  run_dir, _ = finished
  train_compile.main(["train_compile.py", os.path.join(run_dir, "config.yml"), "compile_topology=cpu"])
  assert "compiled for 8 x cpu" in capsys.readouterr().out
