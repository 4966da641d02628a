"""Writes processors/pixels.safetensors: transformers' Gemma 3 and Llama 4 image processors' tiles (float32
[N, H, W, C]) for every helpers.PROCESSED case, keyed by helpers.processed_key; and processors/ids.json:
Llama4Processor's ids for the helpers.L4V_LAYOUTS prompts and Gemma3Processor's for helpers.G3_PROMPTS and the
SFT row. Needs transformers and torchvision
(TEST=1 TORCH=1 bash setup.sh). Deterministic: a rerun rewrites the same bytes.

  python3 MaxText/tests/hf_references/make_processors.py          # write
  python3 MaxText/tests/hf_references/make_processors.py --check  # compare the live processors with the file
"""

import json
import os
import sys
import tempfile

import numpy as np
from safetensors import numpy as safetensors_numpy

from MaxText.tests import helpers
from MaxText.tests.helpers import HF_REFERENCES, PROCESSED, committed_processed, hf_processed, processed_key

PATH = os.path.join(HF_REFERENCES, "processors", "pixels.safetensors")
IDS_PATH = os.path.join(HF_REFERENCES, "processors", "ids.json")


def live_ids():
  ids = {"llama4-layout": {helpers.l4v_layout_key(s): helpers.hf_layout_ids(s) for s in helpers.L4V_LAYOUTS}}
  with tempfile.TemporaryDirectory() as directory:
    helpers.gemma3_tokenizer(directory)
    processor = helpers.gemma3_processor(directory)
    cases = [*helpers.G3_PROMPTS, (helpers.g3_sft_text(directory), 2, False)]
    ids["gemma3-prompts"] = {helpers.g3_prompt_key(*c): helpers.hf_gemma3_prompt_ids(processor, *c) for c in cases}
  return ids


def live():
  return {processed_key(case): np.ascontiguousarray(hf_processed(case), np.float32) for case in PROCESSED}


def problems():
  """Keys whose committed tiles differ from the live processors' (empty: current)."""
  now, old = live(), committed_processed()
  wrong = [k for k in now if k not in old or not np.array_equal(now[k], old[k])]
  wrong += [f"{k} (not a PROCESSED case)" for k in old if k not in now]
  return wrong + (["ids.json differs"] if live_ids() != helpers.committed_ids() else [])


def main(argv):
  """argv: the program name, then [--check]; exits 1 when --check finds the files stale."""
  if "--check" in argv[1:]:
    wrong = problems()
    print("processors: " + ("; ".join(wrong) or "current"))
    if wrong:
      sys.exit(1)
    return
  os.makedirs(os.path.dirname(PATH), exist_ok=True)
  safetensors_numpy.save_file(live(), PATH)
  with open(IDS_PATH, "w") as f:
    json.dump(live_ids(), f, indent=1, sort_keys=True)
    f.write("\n")
  print(f"processors: written ({os.path.getsize(PATH)} bytes)")


if __name__ == "__main__":
  main(sys.argv)
