"""The losses of a few loss_fingerprint cases equal, to the last bit, those recorded in
end_to_end/cpu/loss_fingerprint.json before the structure work (issue 38: one trainer, family folders, the plan in
two floors): a refactor that moves code must not move a loss. Recorded on this project's 2-core x86 CPU machines;
XLA:CPU's results depend on the CPU's vector units: a kind of host whose losses differ has its own record in
end_to_end/cpu/loss_fingerprint_hosts.json, under its signature (`python3 end_to_end/cpu/loss_fingerprint.py
--host`). To add one, at a commit that passes this test on a recorded host:
  python3 end_to_end/cpu/loss_fingerprint.py --cases <the eight below, comma-separated> --out /tmp/host.json
  python3 end_to_end/cpu/loss_fingerprint.py --record-host /tmp/host.json"""

import json
import os
import subprocess
import sys

import pytest

from MaxText.tests.conftest import NIGHTLY, ROOT
from MaxText.tests.helpers import end_to_end_script

RECORDED = os.path.join(ROOT, "end_to_end", "cpu", "loss_fingerprint.json")
IN_PROCESS = ["family/llama2", "family/deepseek3", "layout/pp2", "layout/lora", "layout/vocab-tiling"]
OBJECTIVES = ["objective/resume", "objective/dpo", "objective/grpo"]


@pytest.fixture(scope="module")
def recorded():
  """The record, with this kind of host's own record over it where it has one (the script's docstring)."""
  with open(RECORDED) as f:
    return end_to_end_script("loss_fingerprint").recorded_for_this_host(json.load(f))


def test_each_kind_of_host_records_every_case_of_this_test(monkeypatch):
  """A host's own record holds all eight cases (so none falls back to another CPU's bits), and is what a host
  with that signature reads; any other host reads loss_fingerprint.json as it is."""
  fingerprint = end_to_end_script("loss_fingerprint")
  assert fingerprint.host_signature().split()  # this host's: its vendor, then the vector features it has
  with open(fingerprint.HOSTS) as f:
    hosts = json.load(f)
  with open(RECORDED) as f:
    default = json.load(f)
  assert hosts and set(IN_PROCESS + OBJECTIVES) <= set(default)
  for signature, cases in hosts.items():
    assert set(cases) == set(IN_PROCESS + OBJECTIVES), signature
    monkeypatch.setattr(fingerprint, "host_signature", lambda signature=signature: signature)
    assert fingerprint.recorded_for_this_host(default) == {**default, **cases}
  monkeypatch.setattr(fingerprint, "host_signature", lambda: "GenuineIntel avx2 fma")
  assert fingerprint.recorded_for_this_host(default) == default


def run_fingerprint(out_dir, cases) -> dict:
  """The script run once on `cases`, as it recorded them: XLA's default optimisation and 8 CPU devices (the tests'
  own fast-compile flags, conftest.py, may change a loss's last bit). The objective cases run the users' command
  lines in subprocesses on tiny numpy-made models, at the script's own --fixtures default, since the data split of
  the DPO case hashes the data's path."""
  out = out_dir / "losses.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own, as it recorded
  command = [sys.executable, "end_to_end/cpu/loss_fingerprint.py", "--cases", ",".join(cases)]
  result = subprocess.run([*command, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return json.loads(out.read_text())


# The whole suite runs two in-process cases (MoE with MLA and routing groups; a dense model pipelined over 2
# stages: ~20 CPU-seconds in one process with its start); the nightly tier the other six (~75: the dense family,
# LoRA and vocabulary tiling in process, and the three command lines, SFT, DPO and GRPO on converted models). dpo_test,
# rl_test, lora_test and train_test check those in the whole suite to float tolerance rather than to the bit.
IN_SUITE = ["family/deepseek3", "layout/pp2"]
IN_NIGHTLY = [case for case in IN_PROCESS + OBJECTIVES if case not in IN_SUITE]


@pytest.fixture(scope="module")
def in_suite(tmp_path_factory):
  return run_fingerprint(tmp_path_factory.mktemp("fingerprint"), IN_SUITE)


@pytest.fixture(scope="module")
def in_nightly(tmp_path_factory):
  return run_fingerprint(tmp_path_factory.mktemp("fingerprint_nightly"), IN_NIGHTLY)


CASES = [pytest.param(n, marks=pytest.mark.slow) for n in IN_SUITE]
CASES += [pytest.param(n, marks=NIGHTLY) for n in IN_NIGHTLY]


@pytest.mark.parametrize("name", CASES)
def test_losses_are_unchanged(recorded, request, name):
  fingerprint = request.getfixturevalue("in_suite" if name in IN_SUITE else "in_nightly")
  assert fingerprint[name] == recorded[name]
