"""The losses of a few loss_fingerprint cases equal, to the last bit, those recorded in
end_to_end/cpu/loss_fingerprint.json before the structure work (issue 38: one trainer, family folders, the plan in
two floors): a refactor that moves code must not move a loss. Recorded on this project's 2-core x86 CPU machines;
XLA:CPU's results depend on the CPU's vector units, so on another kind of machine regenerate the file from the
parent commit (`python3 end_to_end/cpu/loss_fingerprint.py --out end_to_end/cpu/loss_fingerprint.json`)."""

import json
import os
import subprocess
import sys

import pytest

from MaxText.tests.conftest import ROOT

RECORDED = os.path.join(ROOT, "end_to_end", "cpu", "loss_fingerprint.json")
IN_PROCESS = ["family/llama2", "family/deepseek3", "layout/pp2", "layout/lora", "layout/vocab-tiling"]
OBJECTIVES = ["objective/resume", "objective/dpo", "objective/grpo"]


@pytest.fixture(scope="module")
def recorded():
  with open(RECORDED) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def fingerprint(tmp_path_factory):
  """The script run once on all eight cases, as it recorded them: XLA's default optimisation and 8 CPU devices
  (the tests' own fast-compile flags, conftest.py, may change a loss's last bit). The objective cases run the
  users' command lines in subprocesses on tiny numpy-made models, at the script's own --fixtures default,
  since the data split of the DPO case hashes the data's path."""
  out = tmp_path_factory.mktemp("fingerprint") / "losses.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own, as it recorded
  command = [sys.executable, "end_to_end/cpu/loss_fingerprint.py", "--cases", ",".join(IN_PROCESS + OBJECTIVES)]
  result = subprocess.run([*command, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.slow  # eight tiny trainings, five in one process and three through the command lines
@pytest.mark.parametrize("name", IN_PROCESS + OBJECTIVES)
def test_losses_are_unchanged(recorded, fingerprint, name):
  assert fingerprint[name] == recorded[name]
