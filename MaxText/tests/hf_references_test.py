"""The committed Hugging Face references (hf_references/, written by hf_references/make.py): every FAMILIES
entry has one, made from its current entry; in the `torch` tier, a live transformers build gives the same files
and outputs (a stale reference fails here), and every family's export reloads in transformers, bit-exact."""

import json
import os

import numpy as np
import pytest

from MaxText import config
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.tests.conftest import quick_for
from MaxText.tests.helpers import (
  FAMILIES,
  HF_DECODE,
  HF_REFERENCES,
  PARITY_NEW,
  PROMPTS,
  TOKENS,
  HFReference,
  hf_kwargs,
  hf_model,
)

REGENERATE = "regenerate with python3 MaxText/tests/hf_references/make.py (after TORCH=1 bash setup.sh)"


def contains(have, want):
  """Every key of want in have with its value (nested dicts: their keys alike)."""
  if isinstance(want, dict):
    return isinstance(have, dict) and all(k in have and contains(have[k], v) for k, v in want.items())
  return have == want


@pytest.mark.quick
def test_every_family_has_its_current_reference():
  """One directory per FAMILIES entry, made from that entry as it is now (class, arguments, decode settings);
  its config.json carries the arguments it names; the outputs have the shapes the tests read."""
  made = sorted(d for d in os.listdir(HF_REFERENCES) if os.path.isfile(os.path.join(HF_REFERENCES, d, "config.json")))
  assert made == sorted(FAMILIES), REGENERATE
  for family, (cls, _) in FAMILIES.items():
    directory = os.path.join(HF_REFERENCES, family)
    entry = json.load(open(os.path.join(directory, "reference.json")))
    want = {"class": cls, "kwargs": json.loads(json.dumps(hf_kwargs(family))), "decode": HF_DECODE.get(family, {})}
    assert entry == want, f"{family}: its FAMILIES entry changed; {REGENERATE} {family}"
    hf = json.load(open(os.path.join(directory, "config.json")))  # aliases (num_experts) saved by their own name
    assert contains(hf, {k: v for k, v in want["kwargs"].items() if k in hf}), family
    ref = HFReference(family)
    assert ref.logits.shape == (*TOKENS.shape, 64) and ref.logits.dtype == np.float32, family
    assert ref.greedy.shape == (len(PROMPTS), PARITY_NEW), family


@pytest.mark.torch
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_equals_a_live_transformers_build(family):
  """make.py's build now: the same config.json and tensors (bit for bit), logits and greedy tokens."""
  from MaxText.tests.hf_references import make  # noqa: PLC0415 (imports torch)

  assert make.check(family) == [], f"{family}: {REGENERATE} {family}"


@pytest.mark.torch
@pytest.mark.parametrize("family", quick_for(sorted(FAMILIES), "llama3.1"))
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
