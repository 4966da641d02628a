"""Runs the end_to_end scripts that fit the CPU suite (the quick start itself is too long: run
end_to_end/cpu/quickstart.sh by hand or in a nightly job)."""

import os
import subprocess

import pytest

from MaxText.tests.conftest import COMPILE_CACHE_ENV, ROOT


def run_script(name, tmp_path, timeout):
  """end_to_end/cpu/<name> on tmp_path; its entry points share the session's compilation cache (CPU only)."""
  env = {**os.environ, **COMPILE_CACHE_ENV}
  command = ["bash", f"end_to_end/cpu/{name}", str(tmp_path)]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # over 40 s on 2 busy cores (2026-11-27): five entry points, each compiling
def test_smoke_script(tmp_path):
  result = run_script("smoke.sh", tmp_path, 600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "OK " in result.stdout
  assert "MFU" in result.stdout


@pytest.mark.slow  # 2-3 minutes on 2 busy cores: five entry points, each compiling
def test_sft_script(tmp_path):
  result = run_script("sft.sh", tmp_path, 900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK sft:" in result.stdout and "Output: 'Tokyo.'" in result.stdout
  assert "export: the 21 tensors of" in result.stdout  # checked without torch; transformers generates where installed


@pytest.mark.slow  # ~3 minutes on 2 busy cores: convert, SFT, GRPO, decode, export, each compiling
def test_post_train_script(tmp_path):
  result = run_script("post_train.sh", tmp_path, 900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK post_train:" in result.stdout and "100 prompts from" in result.stdout


@pytest.mark.slow  # ~2 minutes on 2 idle cores: convert, fine-tune with images, three decodes, export
def test_multimodal_script(tmp_path):
  result = run_script("multimodal.sh", tmp_path, 900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK multimodal:" in result.stdout and "export: the 67 tensors of" in result.stdout
  for colour in ("red", "green", "blue"):
    assert f"output: '{colour}.'" in result.stdout.lower()


@pytest.mark.slow  # ~3 CPU-minutes (teacher, online, top-k generation, offline, scratch runs, each compiling)
def test_distillation_script(tmp_path):
  result = subprocess.run(
    ["bash", "end_to_end/cpu/distillation.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=2400
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK distillation:" in result.stdout and "online: KL to the teacher" in result.stdout
