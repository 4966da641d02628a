"""Runs the end_to_end scripts that fit the CPU suite (the quick start itself is too long: run
end_to_end/cpu/quickstart.sh by hand or in a nightly job)."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_script(tmp_path):
  result = subprocess.run(
    ["bash", "end_to_end/cpu/smoke.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "OK " in result.stdout
  assert "MFU" in result.stdout


@pytest.mark.slow  # 2-3 minutes on 2 busy cores: five entry points, each compiling
def test_sft_script(tmp_path):
  result = subprocess.run(
    ["bash", "end_to_end/cpu/sft.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK sft:" in result.stdout and "Output: 'Tokyo.'" in result.stdout


@pytest.mark.slow  # ~3 minutes on 2 busy cores: convert, SFT, GRPO, decode, export, each compiling
def test_post_train_script(tmp_path):
  result = subprocess.run(
    ["bash", "end_to_end/cpu/post_train.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK post_train:" in result.stdout and "100 prompts from" in result.stdout


@pytest.mark.slow  # ~2 minutes on 2 idle cores: convert, fine-tune with images, three decodes, export
def test_multimodal_script(tmp_path):
  result = subprocess.run(
    ["bash", "end_to_end/cpu/multimodal.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK multimodal:" in result.stdout
  for colour in ("red", "green", "blue"):
    assert f"output: '{colour}.'" in result.stdout.lower()


@pytest.mark.slow  # ~3 CPU-minutes (teacher, online, top-k generation, offline, scratch runs, each compiling)
def test_distillation_script(tmp_path):
  result = subprocess.run(
    ["bash", "end_to_end/cpu/distillation.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=2400
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK distillation:" in result.stdout and "online: KL to the teacher" in result.stdout
