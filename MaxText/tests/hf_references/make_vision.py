"""Writes hf_references/vision/<name>/: the tiny random Gemma 3 and Llama 4 vision models of
helpers.build_vision_model (config.json, model.safetensors, generation_config.json) and transformers' float32
logits and greedy tokens on helpers.vision_inputs (reference.safetensors). Needs torch and transformers
(TEST=1 TORCH=1 bash setup.sh). Deterministic: a rerun rewrites the same bytes.

  python3 MaxText/tests/hf_references/make_vision.py [NAME ...]          # both by default
  python3 MaxText/tests/hf_references/make_vision.py --check [NAME ...]  # compare a live build with the files
"""

import os
import shutil
import sys
import tempfile

import numpy as np
from safetensors import numpy as safetensors_numpy

from MaxText.tests.helpers import VISION_REFERENCES, build_vision_model, vision_outputs
from MaxText.tests.hf_references.make import write_or_check

NAMES = ["gemma3-vision", "llama4-vision"]


def write(name, directory):
  model = build_vision_model(name)
  shutil.rmtree(directory, ignore_errors=True)
  model.save_pretrained(directory)
  safetensors_numpy.save_file(vision_outputs(name, model), os.path.join(directory, "reference.safetensors"))


def check(name):
  """Differences between a live build of `name` and its committed files (empty: current)."""
  committed = os.path.join(VISION_REFERENCES, name)
  with tempfile.TemporaryDirectory() as tmp:
    write(name, tmp)
    problems = []
    live, old = (safetensors_numpy.load_file(os.path.join(d, "model.safetensors")) for d in (tmp, committed))
    if sorted(live) != sorted(old) or any(not np.array_equal(live[k], old[k]) for k in live):
      problems.append("model.safetensors differs")
    live, old = (safetensors_numpy.load_file(os.path.join(d, "reference.safetensors")) for d in (tmp, committed))
    for key in sorted(set(live) | set(old)):
      if key not in live or key not in old or live[key].shape != old[key].shape:
        problems.append(f"{key}: missing or reshaped")
      elif not np.allclose(live[key], old[key], rtol=1e-5, atol=1e-5):
        problems.append(f"{key} differs")
  return problems


def main(argv):
  write_or_check(argv, NAMES, write, check, VISION_REFERENCES)


if __name__ == "__main__":
  main(sys.argv)
