"""The default install has no torch: the requirements files keep torch, transformers, torchvision and NVIDIA packages
out of `bash setup.sh` and `TEST=1`; the walk-throughs' tiny Hugging Face models are written with numpy, and a
conversion both ways, the export in bfloat16 included, runs with torch unimportable."""

import glob
import json
import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from MaxText.config import load
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.tests.conftest import ROOT
from MaxText.tests.helpers import end_to_end_script

TORCH_PACKAGES = re.compile(r"^(torch|torchvision|transformers|nvidia-.*|jax-cuda.*)$")


def requirement_names(name: str) -> list[str]:
  with open(os.path.join(ROOT, name)) as f:
    lines = [line.split("#")[0].strip() for line in f]
  return [re.split(r"[=<>\[]", line)[0].lower() for line in lines if line]


@pytest.mark.quick
def test_default_and_test_requirements_hold_no_torch_or_nvidia_package():
  for name in ("requirements.txt", "requirements-test.txt", "requirements-tpu.txt"):
    assert not [p for p in requirement_names(name) if TORCH_PACKAGES.match(p)], name
  assert {"torch", "transformers", "torchvision"} <= set(requirement_names("requirements-torch.txt"))
  result = subprocess.run(["bash", "setup.sh", "NOPE=1"], cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 2 and "TORCH=1" in result.stderr and "GPU_AOT=1" in result.stderr


def tensors(directory: str) -> dict[str, np.ndarray]:
  out = {}
  for path in glob.glob(os.path.join(directory, "*.safetensors")):
    out |= load_file(path)
  return out


@pytest.fixture
def no_torch(monkeypatch):
  """`import torch` and `import transformers` fail, as in a venv without them."""
  for name in ("torch", "transformers", "safetensors.torch"):
    monkeypatch.setitem(sys.modules, name, None)


def test_tiny_chat_model_converts_and_exports_without_torch(tmp_path, no_torch):
  """make_tiny_chat_model's Llama -> ours -> Hugging Face: float32 back exactly, bfloat16 as ml_dtypes rounds it
  (the bytes torch's .to(torch.bfloat16) gives), under the same names, with the config the model was made with."""
  tiny = end_to_end_script("make_tiny_chat_model")
  hf = str(tmp_path / "hf")
  os.makedirs(hf)
  tiny.write_model(hf)
  original = load_file(os.path.join(hf, "model.safetensors"))
  assert original["model.norm.weight"].tolist() == [1.0] * 64 and 0.018 < original["lm_head.weight"].std() < 0.022
  out = str(tmp_path / "ours")
  params = hf_to_maxtext.convert(hf, out, scan_layers=False)
  c = load([os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={params}"], {})
  for dtype, cast in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
    back = str(tmp_path / dtype)
    maxtext_to_hf.convert(c, back, dtype=dtype)
    exported = tensors(back)
    assert exported.keys() == original.keys()
    for name, array in original.items():
      assert exported[name].dtype == cast and np.array_equal(exported[name], array.astype(cast)), (dtype, name)
  with open(os.path.join(hf, "config.json")) as f, open(os.path.join(tmp_path, "float32", "config.json")) as g:
    made, written = json.load(f), json.load(g)
  assert {k: written[k] for k in ("hidden_size", "num_hidden_layers", "head_dim")} == {
    k: made[k] for k in ("hidden_size", "num_hidden_layers", "head_dim")
  }


def test_tiny_vision_model_has_the_tensors_our_converter_reads(tmp_path, no_torch):
  """make_tiny_vision_model's Gemma 3: every tensor the converter maps is there with its shape (convert checks
  the headers first), the projector starts at zero and the SigLIP kernels are Xavier-uniform."""
  tiny = end_to_end_script("make_tiny_vision_model")
  hf = str(tmp_path / "hf")
  os.makedirs(hf)
  tiny.write_model(hf)
  weights = load_file(os.path.join(hf, "model.safetensors"))
  assert not weights["multi_modal_projector.mm_input_projection_weight"].any()
  q = weights["vision_tower.encoder.layers.0.self_attn.q_proj.weight"]
  assert np.abs(q).max() <= np.sqrt(6 / 64) and 0.15 < q.std() < 0.2
  hf_to_maxtext.convert(hf, str(tmp_path / "ours"), scan_layers=True)
  assert os.path.isfile(tmp_path / "ours" / "config.yml")
