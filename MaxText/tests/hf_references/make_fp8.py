"""Writes fp8/deepseek3.safetensors: transformers' float32 logits on helpers.fp8_tokens() of the deepseek3
reference model with its weights replaced by what their FP8 block-scaled form (helpers.write_fp8_checkpoint,
numpy and ml_dtypes) stands for. Needs torch and transformers (TEST=1 TORCH=1 bash setup.sh).

  python3 MaxText/tests/hf_references/make_fp8.py          # write
  python3 MaxText/tests/hf_references/make_fp8.py --check  # compare a live transformers run with the file
"""

import os
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors import numpy as safetensors_numpy

from MaxText.tests.helpers import HF_REFERENCES, fp8_tokens, hf_model, write_fp8_checkpoint

PATH = os.path.join(HF_REFERENCES, "fp8", "deepseek3.safetensors")


def live():
  with tempfile.TemporaryDirectory() as tmp:
    _, hf_path = hf_model("deepseek3", tmp)
    float_path = os.path.join(tmp, "dequantized")
    write_fp8_checkpoint(hf_path, float_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(float_path, attn_implementation="eager").float().eval()
    with torch.no_grad():
      return {"logits": model(torch.tensor(fp8_tokens())).logits.numpy().astype(np.float32)}


def main(argv):
  """argv: the program name, then [--check]; exits 1 when --check finds the file stale."""
  now = live()
  if "--check" in argv[1:]:
    old = safetensors_numpy.load_file(PATH)
    current = np.allclose(now["logits"], old["logits"], rtol=1e-5, atol=1e-5)
    print("fp8: " + ("current" if current else "logits differ"))
    if not current:
      sys.exit(1)
    return
  os.makedirs(os.path.dirname(PATH), exist_ok=True)
  safetensors_numpy.save_file(now, PATH)
  print("fp8: written")


if __name__ == "__main__":
  main(sys.argv)
