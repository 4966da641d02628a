"""Writes the committed Hugging Face references the tests read without torch: for every helpers.FAMILIES and
HF_EXTRA entry, the tiny random model (config.json, model.safetensors, generation_config.json) under <name>/,
its float32 logits on helpers.TOKENS and its greedy tokens on helpers.PROMPTS (batched, left-padded) in
reference.safetensors, and what it was made from (helpers.hf_entry) in reference.json. Needs torch and
transformers (TEST=1 TORCH=1 bash setup.sh). Deterministic: a rerun rewrites the same bytes.

  python3 MaxText/tests/hf_references/make.py [NAME ...]          # all by default
  python3 MaxText/tests/hf_references/make.py --check [NAME ...]  # compare a live transformers build with the files
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors import numpy as safetensors_numpy

from MaxText.tests.helpers import HF_DECODE, HF_REFERENCES, PROMPTS, TOKENS, hf_entry, hf_greedy, hf_reference_names


def build(name, **config_overrides):
  """The tiny random HF model `name` (float32, eager attention), randomised as its hf_entry's init says."""
  entry = hf_entry(name)
  torch.manual_seed(0)
  cfg = getattr(transformers, entry["class"])(**{**entry["kwargs"], **config_overrides})
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  with torch.no_grad():
    if entry["init"] == "norms":
      for n, p in model.named_buffers():
        if "bias" in n:  # DeepSeek's expert-selection bias
          p.copy_(torch.randn_like(p) * 0.1)
    for n, p in model.named_parameters():
      p.copy_(INITS[entry["init"]](n, p, name))
  return model


def norms_init(n, p, name):
  """Norm weights and biases random (gemma's zero-centred norms around 0), the rest as transformers inits."""
  if "norm" in n or ".ln_" in n or n.endswith("bias"):
    return torch.randn_like(p) * 0.5 + (1.0 if n.endswith("weight") and "gemma" not in name else 0.0)
  if n.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's router scales (transformers: ones)
    return torch.randn_like(p) * 0.5 + 1.0
  return p


def all_init(n, p, name):
  return torch.randn_like(p) * 0.5 + 1.0 if "norm" in n else torch.randn_like(p) * 0.3


def zero_centred_init(n, p, name):
  """Zero-centred norms (1 + w) around 0 and the DeltaNet's plain output norm around 1; dt_bias random."""
  if "norm" in n:
    return torch.randn_like(p) * 0.5 + (1.0 if "linear_attn.norm" in n else 0.0)
  return torch.randn_like(p) if n.endswith("dt_bias") else p


INITS = {
  "norms": norms_init,
  "all": all_init,
  "all-bf16": lambda n, p, name: all_init(n, p, name).bfloat16().float(),
  "zero-centred": zero_centred_init,
}


def outputs(family, model):
  """{"logits": logits on TOKENS, "greedy": greedy tokens on PROMPTS (HF_DECODE's config changes applied)}."""
  with torch.no_grad():
    logits = model(torch.tensor(TOKENS)).logits.numpy()
  decoder = build(family, **HF_DECODE[family]) if family in HF_DECODE else model
  if decoder is not model:  # the same weights: only forward-pass settings differ
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), decoder.state_dict().values()))
  return {"logits": logits.astype(np.float32), "greedy": hf_greedy(decoder, PROMPTS).astype(np.int64)}


def write(family, directory):
  """The model's files and reference outputs under directory (replaced)."""
  model = build(family)
  shutil.rmtree(directory, ignore_errors=True)
  model.save_pretrained(directory)
  if family == "kimi-k2":  # as Kimi's checkpoints name it: its own model_type for the DeepSeek V3 architecture
    path = os.path.join(directory, "config.json")
    json.dump({**json.load(open(path)), "model_type": "kimi_k2"}, open(path, "w"), indent=2, sort_keys=True)
  safetensors_numpy.save_file(outputs(family, model), os.path.join(directory, "reference.safetensors"))
  with open(os.path.join(directory, "reference.json"), "w") as f:
    json.dump(hf_entry(family), f, indent=2, sort_keys=True)
    f.write("\n")


def check(family):
  """Differences between a fresh live build of `family` and its committed files (empty: current)."""
  committed = os.path.join(HF_REFERENCES, family)
  with tempfile.TemporaryDirectory() as tmp:
    write(family, tmp)
    problems = []
    for name in sorted(set(os.listdir(tmp)) | set(os.listdir(committed))):
      a, b = os.path.join(tmp, name), os.path.join(committed, name)
      if not (os.path.exists(a) and os.path.exists(b)):
        problems.append(f"{name}: only in {'the live build' if os.path.exists(a) else 'the committed files'}")
      elif name == "reference.safetensors":
        live, old = safetensors_numpy.load_file(a), safetensors_numpy.load_file(b)
        if not np.allclose(live["logits"], old["logits"], rtol=1e-5, atol=1e-5):
          problems.append(f"logits differ by up to {np.abs(live['logits'] - old['logits']).max():.3g}")
        if not np.array_equal(live["greedy"], old["greedy"]):
          problems.append("greedy tokens differ")
      elif name == "config.json":
        live, old = (json.load(open(f)) for f in (a, b))
        if {**live, "transformers_version": None} != {**old, "transformers_version": None}:
          problems.append("config.json differs")
      elif open(a, "rb").read() != open(b, "rb").read():
        problems.append(f"{name} differs")
  return problems


def write_or_check(argv, names, write, check, directory):
  """The generators' command line, argv: the program name, then [--check] [NAME ...] (default: `names`). Writes each
  NAME under `directory`, or with --check prints what differs between a live build and its files, exiting 1 when
  any is stale."""
  checking = "--check" in argv[1:]
  failed = False
  for name in [a for a in argv[1:] if a != "--check"] or names:
    if checking:
      problems = check(name)
      failed |= bool(problems)
      print(f"{name}: {'; '.join(problems) or 'current'}")
    else:
      write(name, os.path.join(directory, name))
      print(f"{name}: written")
  if failed:
    sys.exit(1)


def main(argv):
  write_or_check(argv, hf_reference_names(), write, check, HF_REFERENCES)


if __name__ == "__main__":
  main(sys.argv)
