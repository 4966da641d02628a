"""Writes processors/pixels.safetensors: transformers' Gemma 3 and Llama 4 image processors' tiles (float32
[N, H, W, C]) for every helpers.PROCESSED case, keyed by helpers.processed_key. Needs transformers and torchvision
(TEST=1 TORCH=1 bash setup.sh). Deterministic: a rerun rewrites the same bytes.

  python3 MaxText/tests/hf_references/make_processors.py          # write
  python3 MaxText/tests/hf_references/make_processors.py --check  # compare the live processors with the file
"""

import os
import sys

import numpy as np
from safetensors import numpy as safetensors_numpy

from MaxText.tests.helpers import HF_REFERENCES, PROCESSED, committed_processed, hf_processed, processed_key

PATH = os.path.join(HF_REFERENCES, "processors", "pixels.safetensors")


def live():
  return {processed_key(case): np.ascontiguousarray(hf_processed(case), np.float32) for case in PROCESSED}


def problems():
  """Keys whose committed tiles differ from the live processors' (empty: current)."""
  now, old = live(), committed_processed()
  wrong = [k for k in now if k not in old or not np.array_equal(now[k], old[k])]
  return wrong + [f"{k} (not a PROCESSED case)" for k in old if k not in now]


def main(argv):
  if "--check" in argv:
    wrong = problems()
    print("processors: " + ("; ".join(wrong) or "current"))
    return 1 if wrong else 0
  os.makedirs(os.path.dirname(PATH), exist_ok=True)
  safetensors_numpy.save_file(live(), PATH)
  print(f"processors: written ({os.path.getsize(PATH)} bytes)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
