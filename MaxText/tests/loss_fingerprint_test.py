"""The losses of a few loss_fingerprint cases equal, to the last bit, those recorded in
end_to_end/cpu/loss_fingerprint.json before the structure work (issue 38: one trainer, family folders, the plan in
two floors): a refactor that moves code must not move a loss. Recorded on this project's 2-core x86 CPU machines;
XLA:CPU's results depend on the CPU's vector units, so on another kind of machine regenerate the file from the
parent commit (`python3 end_to_end/cpu/loss_fingerprint.py --out end_to_end/cpu/loss_fingerprint.json`)."""

import json
import os

import pytest

from MaxText.tests.conftest import ROOT
from MaxText.tests.helpers import end_to_end_script

RECORDED = os.path.join(ROOT, "end_to_end", "cpu", "loss_fingerprint.json")
IN_PROCESS = ["family/llama2", "family/deepseek3", "layout/pp2", "layout/lora", "layout/vocab-tiling"]
OBJECTIVES = ["resume", "dpo", "grpo"]


@pytest.fixture(scope="module")
def recorded():
  with open(RECORDED) as f:
    return json.load(f)


@pytest.mark.slow  # five tiny trainings in this process
@pytest.mark.parametrize("name", IN_PROCESS)
def test_training_losses_are_unchanged(recorded, tmp_path, name):
  fingerprint = end_to_end_script("loss_fingerprint")
  assert fingerprint.run_case(name, fingerprint.CASES[name], str(tmp_path)) == recorded[name]


@pytest.mark.slow  # the users' command lines in subprocesses, on tiny converted models made once (numpy)
def test_objective_losses_are_unchanged(recorded, tmp_path):
  """One test for all three, so that one process makes the fixtures: at the script's own --fixtures default,
  since the data split of the DPO case hashes the data's path."""
  fingerprint = end_to_end_script("loss_fingerprint")
  fixtures = fingerprint.DEFAULT_FIXTURES
  fingerprint.make_fixtures(fixtures)
  for name in OBJECTIVES:
    assert fingerprint.run_objective(name, fixtures, str(tmp_path)) == recorded[f"objective/{name}"], name
