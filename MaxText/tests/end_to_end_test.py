"""Runs the end_to_end walk-throughs, as users run them: the smoke run in the whole suite, the post-training ones
(SFT, post-training, multimodal, distillation) in the nightly tier (conftest.NIGHTLY): from half a minute to three
each, five or more processes that each import and compile, and each of their stages has tests of its own in the
whole suite (sft_test, dpo_test, rl_test, multimodal_test, distill_test, the conversions' round trips). The quick
start itself is too long: run end_to_end/cpu/quickstart.sh by hand or in the nightly job."""

import subprocess

import pytest

from MaxText.tests.conftest import ROOT, cpu_subprocess_env


def run_script(name, tmp_path, timeout, fast_compile=True):
  """end_to_end/cpu/<name> on tmp_path, on one CPU device as a user runs it (jax's default on CPU; the docs quote
  its losses), not the suite's 8; its entry points share the session's compilation cache (CPU only).
  fast_compile=False compiles as users do too, for a script whose steps, not its compiles, take the time."""
  env = cpu_subprocess_env(1)
  if not fast_compile:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  command = ["bash", f"end_to_end/cpu/{name}", str(tmp_path)]
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # ~25 CPU-seconds on 2 cores (2026-11-28): one train.py run of 20 steps
def test_smoke_script(tmp_path):
  result = run_script("smoke.sh", tmp_path, 600, fast_compile=False)  # 20 steps of a 32K vocabulary: steps dominate
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "OK " in result.stdout
  assert "MFU" in result.stdout


@pytest.mark.nightly
@pytest.mark.slow  # ~30 CPU-seconds on 2 cores (2026-11-28): five entry points, each compiling
def test_sft_script(tmp_path):
  result = run_script("sft.sh", tmp_path, 900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK sft:" in result.stdout and "Output: 'Tokyo.'" in result.stdout
  assert "export: the 21 tensors of" in result.stdout  # checked without torch; transformers generates where installed


@pytest.mark.long
@pytest.mark.nightly
@pytest.mark.slow  # ~55 CPU-seconds on 2 cores (2026-11-28): convert, SFT, DPO, GRPO, decode, export, each compiling
def test_post_train_script(tmp_path):
  result = run_script("post_train.sh", tmp_path, 900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK post_train:" in result.stdout and "100 prompts from" in result.stdout


@pytest.mark.long
@pytest.mark.nightly
@pytest.mark.slow  # ~55 CPU-seconds on 2 cores (2026-11-28): convert, fine-tune with images, three decodes, export
def test_multimodal_script(tmp_path):
  result = run_script("multimodal.sh", tmp_path, 900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK multimodal:" in result.stdout and "export: the 67 tensors of" in result.stdout
  for colour in ("red", "green", "blue"):
    assert f"output: '{colour}.'" in result.stdout.lower()


# ~3 CPU-minutes (2026-11-29: teacher, online, top-k generation, offline, scratch runs), the longest. Its claim
# (distilled students beat the scratch one) needs the teacher's 300 steps: at 150, with students at 50, the offline
# student lost (6.243 against 6.199), and the runs' fixed costs (a tokenizer trained, five compiles) still took two
# thirds of the time.
@pytest.mark.long
@pytest.mark.nightly
@pytest.mark.slow
def test_distillation_script(tmp_path):
  result = run_script("distillation.sh", tmp_path, 2400)  # the script sets its own XLA_FLAGS (one device)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "OK distillation:" in result.stdout and "online: KL to the teacher" in result.stdout
