"""FP8 block-scaled Hugging Face checkpoints (DeepSeek V3 style) are dequantized on import: a tiny
DeepseekV3 quantized here to float8_e4m3fn with [ceil(out/M), ceil(in/N)] scale_inv blocks converts to
a MaxText model whose logits equal the HF model's run on the dequantized weights."""

import json
import os
import shutil

import numpy as np
import pytest

from MaxText.convert import fp8, hf_to_maxtext
from MaxText.errors import ConfigError
from MaxText.tests.conftest import HAS_TORCH
from MaxText.tests.helpers import T, hf_model, maxtext_logits

if HAS_TORCH:  # the `torch`-marked tests' live references
  import torch
  import transformers
  from safetensors import torch as safetensors_torch

BLOCK = (8, 16)  # not square, and partial blocks (q_lora_rank 12, moe_intermediate_size 16, hidden 32)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_blocks(w: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
  """w [out, in] float32 -> (float8_e4m3fn [out, in], scale_inv float32 [ceil(out/M), ceil(in/N)], and the
  float32 weights they stand for), computed in torch, apart from the converter's numpy code."""
  out, inner = w.shape
  rows, cols = -(-out // BLOCK[0]), -(-inner // BLOCK[1])
  padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
  padded[:out, :inner] = w
  blocks = padded.reshape(rows, BLOCK[0], cols, BLOCK[1])
  scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
  full = scale_inv.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:out, :inner]
  q = (w / full).to(torch.float8_e4m3fn)
  return q, scale_inv, q.float() * full


def is_quantized(name: str, tensor: "torch.Tensor") -> bool:
  """As DeepSeek V3 ships: the linear weights of the layers in FP8; embeddings, norms, router, head not."""
  skip = ("norm", "embed_tokens", "lm_head", "mlp.gate.weight")
  return name.endswith(".weight") and tensor.ndim == 2 and not any(s in name for s in skip)


def write_fp8_checkpoint(hf_path: str, float_path: str) -> int:
  """Rewrite hf_path's model.safetensors in FP8 with scale_inv tensors, and write the float weights they
  stand for (same config.json, no quantization_config) to float_path; returns how many weights are FP8."""
  state = safetensors_torch.load_file(os.path.join(hf_path, "model.safetensors"))
  stored, dequantized = {}, {}
  for name, w in state.items():
    if is_quantized(name, w):
      stored[name], stored[name + fp8.SCALE_SUFFIX], dequantized[name] = quantize_blocks(w.float())
    else:
      stored[name] = dequantized[name] = w
  os.makedirs(float_path)
  safetensors_torch.save_file(dequantized, os.path.join(float_path, "model.safetensors"))
  shutil.copy(os.path.join(hf_path, "config.json"), float_path)
  safetensors_torch.save_file(stored, os.path.join(hf_path, "model.safetensors"))
  cfg_path = os.path.join(hf_path, "config.json")
  cfg = json.load(open(cfg_path))
  cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
  cfg["quantization_config"]["weight_block_size"] = list(BLOCK)
  json.dump(cfg, open(cfg_path, "w"))
  return len(stored) - len(state)


@pytest.mark.torch
@pytest.mark.slow  # two conversions of a MoE model and three forward passes: ~2 min on 2 busy cores
def test_fp8_block_scaled_deepseek_v3_imports_as_its_dequantized_weights(tmp_path):
  _, hf_path = hf_model("deepseek3", tmp_path)
  float_path = os.path.join(tmp_path, "dequantized")
  assert write_fp8_checkpoint(hf_path, float_path) > 10
  # The HF model on exactly the weights the FP8 file stands for, loaded the way HF loads any checkpoint.
  model = transformers.AutoModelForCausalLM.from_pretrained(float_path, attn_implementation="eager").float().eval()
  tokens = np.random.default_rng(0).integers(0, 64, (2, T))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out, scan_layers=True)
  np.testing.assert_allclose(maxtext_logits(out, tokens), ref, rtol=1e-5, atol=1e-5)
  hf_to_maxtext.convert(float_path, os.path.join(tmp_path, "mt_float"), scan_layers=True)
  np.testing.assert_array_equal(maxtext_logits(out, tokens), maxtext_logits(os.path.join(tmp_path, "mt_float"), tokens))


def test_fp8_errors_name_what_is_wrong(tmp_path):
  weight = np.zeros((20, 40), fp8.FP8_DTYPES["F8_E4M3"])
  with pytest.raises(ConfigError, match=r"w_scale_inv has shape \(2, 2\).*implies \(3, 3\)"):
    fp8.dequantize(weight, np.ones((2, 2), np.float32), BLOCK, "w")
  for qc in ({"quant_method": "gptq"}, {"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": [128]}):
    with pytest.raises(ConfigError, match="quantization_config .* is not supported"):
      fp8.block_size({"quantization_config": qc})
  assert fp8.block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == (128, 128)
