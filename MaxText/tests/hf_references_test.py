"""The committed Hugging Face references (hf_references/, written by hf_references/make.py): every FAMILIES and
HF_EXTRA entry has one, made from its current entry; in the `torch` tier, a live transformers build gives the
same files and outputs (a stale reference fails here), and every model's export reloads in transformers with
the live model's logits, bit for bit."""

import json
import os

import numpy as np
import pytest

from MaxText import config
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.tests import conftest
from MaxText.tests.helpers import (
  HF_REFERENCES,
  PARITY_NEW,
  PROMPTS,
  TOKENS,
  HFReference,
  hf_entry,
  hf_model,
  hf_reference_names,
)

REGENERATE = "regenerate with python3 MaxText/tests/hf_references/make.py (after TEST=1 TORCH=1 bash setup.sh)"


def contains(have, want):
  """Every key of want in have with its value (nested dicts: their keys alike)."""
  if isinstance(want, dict):
    return isinstance(have, dict) and all(k in have and contains(have[k], v) for k, v in want.items())
  return have == want


@pytest.mark.quick
def test_every_family_has_its_current_reference():
  """One directory per FAMILIES and HF_EXTRA entry, made from that entry as it is now (class, arguments, init,
  decode settings); its config.json carries the arguments it names; the outputs have the shapes tests read."""
  made = sorted(d for d in os.listdir(HF_REFERENCES) if os.path.isfile(os.path.join(HF_REFERENCES, d, "config.json")))
  assert made == hf_reference_names(), REGENERATE
  for name in made:
    directory = os.path.join(HF_REFERENCES, name)
    want = hf_entry(name)
    assert json.load(open(os.path.join(directory, "reference.json"))) == want, f"{name} changed; {REGENERATE} {name}"
    hf = json.load(open(os.path.join(directory, "config.json")))  # aliases (num_experts) saved by their own name
    assert contains(hf, {k: v for k, v in want["kwargs"].items() if k in hf}), name
    ref = HFReference(name)
    assert ref.logits.shape == (*TOKENS.shape, 64) and ref.logits.dtype == np.float32, name
    assert ref.greedy.shape == (len(PROMPTS), PARITY_NEW), name


@pytest.mark.torch
@pytest.mark.parametrize("family", hf_reference_names())
def test_reference_equals_a_live_transformers_build(family):
  """make.py's build now: the same config.json and tensors (bit for bit), logits and greedy tokens."""
  from MaxText.tests.hf_references import make  # noqa: PLC0415 (imports torch)

  assert make.check(family) == [], f"{family}: {REGENERATE} {family}"


@pytest.mark.torch
@pytest.mark.parametrize("family", hf_reference_names())
def test_export_reloads_in_transformers(family, tmp_path):
  """hf_to_maxtext then maxtext_to_hf: transformers loads the export and gives the reference model's logits."""
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  from MaxText.tests.hf_references import make  # noqa: PLC0415

  _, hf_path = hf_model(family, tmp_path)
  out, back = os.path.join(tmp_path, "mt"), os.path.join(tmp_path, "back")
  hf_to_maxtext.convert(hf_path, out)
  maxtext_to_hf.convert(
    config.load([os.path.join(out, "config.yml"), "run_name=t", f"load_parameters_path={out}/params"], {}), back
  )
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
  with torch.no_grad():
    got = reloaded(torch.tensor(TOKENS)).logits.numpy()
    want = make.build(family)(torch.tensor(TOKENS)).logits.numpy()
  np.testing.assert_array_equal(got, want)


class FakeItem:
  def __init__(self, *names):
    self.marks = [getattr(pytest.mark, n) for n in names]
    self.nodeid = "MaxText/tests/fake_test.py::test_fake"  # no fixtures: conftest groups it with no module

  def get_closest_marker(self, name):
    return next((m for m in self.marks if m.name == name), None)

  def add_marker(self, mark):
    self.marks.append(mark)


@pytest.mark.parametrize("has_torch", [True, False])
def test_torch_marked_tests_skip_with_the_opt_in_line_without_torch(monkeypatch, has_torch):
  monkeypatch.setattr(conftest, "HAS_TORCH", has_torch)
  marked, plain = FakeItem("torch", "slow"), FakeItem("slow")
  conftest.pytest_collection_modifyitems(None, [marked, plain])
  skip = marked.get_closest_marker("skip")
  assert plain.get_closest_marker("skip") is None
  assert (skip is None) if has_torch else (skip.kwargs["reason"] == conftest.TORCH_SKIP)
  assert "\n" not in conftest.TORCH_SKIP and "TORCH=1 bash setup.sh" in conftest.TORCH_SKIP
