"""benchmarks/gpu_check.sh, the first run on an NVIDIA GPU, works before any GPU is at hand: --smoke runs its
three rows (cuDNN flash, dot_product, fp8; dot_product attention on a CPU) on a tiny model here."""

import os
import subprocess

import pytest

from MaxText.tests.conftest import ROOT

pytestmark = pytest.mark.slow  # three compiles: about a minute on 2 cores


def test_the_gpu_check_script_runs_its_rows_on_a_tiny_model(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as on one GPU
  done = subprocess.run(
    ["bash", "benchmarks/gpu_check.sh", "--smoke", "--timed=1", f"--out={tmp_path}"],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-3000:]
  (written,) = os.listdir(tmp_path)
  text = (tmp_path / written).read_text()
  rows = [line for line in text.splitlines() if line.startswith("| ") and "(smoke: dot_product)" in line]
  assert len(rows) == 3 and "fp8" in rows[2]
  assert "relative difference 0.00e+00" in text  # the same attention twice under --smoke: the same loss
