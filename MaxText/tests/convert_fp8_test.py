"""FP8 block-scaled Hugging Face checkpoints (DeepSeek V3 style) are dequantized on import: the tiny deepseek3
reference quantized (numpy, ml_dtypes) to float8_e4m3fn with [ceil(out/M), ceil(in/N)] scale_inv blocks converts
to a MaxText model whose logits equal transformers' on the dequantized weights (committed by
hf_references/make_fp8.py); the `torch` tier checks that file and the quantizer against torch."""

import os

import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

from MaxText.convert import fp8, hf_to_maxtext
from MaxText.errors import ConfigError
from MaxText.tests import helpers
from MaxText.tests.helpers import FP8_BLOCK, FP8_MAX, hf_model, maxtext_logits

REGENERATE = "regenerate with python3 MaxText/tests/hf_references/make_fp8.py (after TEST=1 TORCH=1 bash setup.sh)"


@pytest.mark.slow  # two conversions of a MoE model and three forward passes: ~20 s on 2 cores
def test_fp8_block_scaled_deepseek_v3_imports_as_its_dequantized_weights(tmp_path):
  _, hf_path = hf_model("deepseek3", tmp_path)
  float_path = os.path.join(tmp_path, "dequantized")
  assert helpers.write_fp8_checkpoint(hf_path, float_path) > 10
  ref = safetensors_numpy.load_file(os.path.join(helpers.HF_REFERENCES, "fp8", "deepseek3.safetensors"))["logits"]
  tokens = helpers.fp8_tokens()
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out, scan_layers=True)
  np.testing.assert_allclose(maxtext_logits(out, tokens), ref, rtol=1e-5, atol=1e-5)
  hf_to_maxtext.convert(float_path, os.path.join(tmp_path, "mt_float"), scan_layers=True)
  np.testing.assert_array_equal(maxtext_logits(out, tokens), maxtext_logits(os.path.join(tmp_path, "mt_float"), tokens))


@pytest.mark.torch
def test_the_quantizer_equals_torchs_float8_cast(tmp_path):
  """helpers.fp8_quantize (numpy, ml_dtypes) gives torch's float8_e4m3fn bytes and scales on every quantized
  weight of the deepseek3 reference."""
  import torch  # noqa: PLC0415 (the torch tier)

  _, hf_path = hf_model("deepseek3", tmp_path)
  for name, w in safetensors_numpy.load_file(os.path.join(hf_path, "model.safetensors")).items():
    if not helpers.fp8_is_quantized(name, w):
      continue
    t = torch.from_numpy(w.astype(np.float32))
    (out, inner), (m, n) = t.shape, FP8_BLOCK
    padded = torch.zeros(-(-out // m) * m, -(-inner // n) * n)
    padded[:out, :inner] = t
    scale_inv = padded.reshape(padded.shape[0] // m, m, -1, n).abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    full = scale_inv.repeat_interleave(m, 0).repeat_interleave(n, 1)[:out, :inner]
    q, s, dequantized = helpers.fp8_quantize(w.astype(np.float32))
    np.testing.assert_array_equal(s, scale_inv.numpy())
    assert q.tobytes() == (t / full).to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes(), name
    np.testing.assert_array_equal(dequantized, ((t / full).to(torch.float8_e4m3fn).float() * full).numpy())


@pytest.mark.torch
def test_committed_fp8_reference_is_a_live_transformers_run():
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  script = os.path.join(helpers.HF_REFERENCES, "make_fp8.py")
  done = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
  assert done.returncode == 0, f"{done.stdout[-500:]}{done.stderr[-500:]}\n{REGENERATE}"


def test_fp8_errors_name_what_is_wrong(tmp_path):
  weight = np.zeros((20, 40), fp8.FP8_DTYPES["F8_E4M3"])
  with pytest.raises(ConfigError, match=r"w_scale_inv has shape \(2, 2\).*implies \(3, 3\)"):
    fp8.dequantize(weight, np.ones((2, 2), np.float32), FP8_BLOCK, "w")
  for qc in ({"quant_method": "gptq"}, {"quant_method": "fp8"}, {"quant_method": "fp8", "weight_block_size": [128]}):
    with pytest.raises(ConfigError, match="quantization_config .* is not supported"):
      fp8.block_size({"quantization_config": qc})
  assert fp8.block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == (128, 128)
