"""gpt-oss against Hugging Face transformers (PyTorch CPU) on a tiny random model (hf_references/gpt-oss):
logits, 16 greedy tokens, the bit-exact round trip, the MXFP4 expert import (dequantized as transformers does)
and its bfloat16 export; the KV-cache path (sinks, sliding windows); training on the quick-start data;
presets and FLOPs."""

import json
import os

import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

from MaxText import config, flops, planner, train
from MaxText.convert import hf_to_maxtext, maxtext_to_hf, mxfp4
from MaxText.errors import ConfigError
from MaxText.inference import Engine
from MaxText.tests.helpers import (
  PROMPTS,
  TOKENS,
  assert_cache_equals_forward,
  assert_export_is_exact,
  hf_config,
  hf_keys,
  hf_model,
  maxtext_logits,
)

# The tiny model: helpers.GPT_OSS, committed as hf_references/gpt-oss (and gpt-oss-bf16, its weights rounded to
# bfloat16 so a bfloat16 export is exact).


def load(out, *overrides):
  return config.load([os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", *overrides], {})


def test_logits_greedy_tokens_and_exact_round_trip(tmp_path):
  reference, hf_path = hf_model("gpt-oss", tmp_path)
  tokens, ref = TOKENS, reference.logits
  w = safetensors_numpy.load_file(os.path.join(hf_path, "model.safetensors"))
  x = w["model.embed_tokens.weight"][tokens].reshape(-1, 32)
  eps = json.load(open(os.path.join(hf_path, "config.json")))["rms_norm_eps"]
  hidden = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w["model.layers.0.post_attention_layernorm.weight"]
  assert ((hidden @ w["model.layers.0.mlp.experts.gate_up_proj"][0, :, ::2]) > 1.5).any()  # the clamp acts
  scanned = os.path.join(tmp_path, "scan")  # a scanned sliding/full pair and an unscanned remainder layer
  hf_to_maxtext.convert(hf_path, scanned, scan_layers=True)
  np.testing.assert_allclose(maxtext_logits(scanned, tokens), ref, rtol=1e-5, atol=1e-5)

  c = load(scanned, f"load_parameters_path={scanned}/params", "max_target_length=32")
  c = c.replace(max_prefill_predict_length=16, ici_fsdp_parallelism=1, ici_data_parallelism=-1)
  completions = Engine.load(c).generate(PROMPTS, 16, strategy="greedy", stop_tokens=[])
  want = reference.greedy
  for row, completion in enumerate(completions.completions):
    np.testing.assert_array_equal(completion.tokens, want[row], err_msg=f"prompt {row}")

  back = os.path.join(tmp_path, "back")
  assert_export_is_exact(load(scanned, f"load_parameters_path={scanned}/params"), hf_path, back)


def quantize_mxfp4(weight):
  """HF expert weight [E, in, out] -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]): per
  block of 32 along `in`, the E8M0 exponent that brings the largest magnitude within 6 (FP4's largest),
  each value rounded to the nearest E2M1 code, two codes per byte, the low nibble first."""
  w = np.swapaxes(weight, -1, -2)
  w = w.reshape(*w.shape[:-1], -1, 32)
  exponent = np.ceil(np.log2(np.maximum(np.abs(w).max(-1), 1e-30) / 6.0)).astype(np.int32)
  scaled = w / np.exp2(exponent)[..., None]
  magnitude = np.abs(np.abs(scaled)[..., None] - mxfp4.E2M1[:8]).argmin(-1)
  codes = (magnitude + 8 * (scaled < 0)).astype(np.uint8)
  return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).astype(np.uint8)


@pytest.mark.torch
def test_mxfp4_experts_import_as_transformers_dequantizes_and_export_to_bfloat16(tmp_path):
  import torch
  import transformers
  from safetensors import torch as safetensors_torch

  _, hf_path = hf_model("gpt-oss-bf16", tmp_path)
  state = safetensors_torch.load_file(os.path.join(hf_path, "model.safetensors"))
  dequantized = {}
  for name in [n for n in state if n.endswith(("gate_up_proj", "down_proj"))]:
    blocks, scales = quantize_mxfp4(state.pop(name).numpy())
    state[name + "_blocks"], state[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    ref = transformers.integrations.mxfp4.convert_moe_packed_tensors(
      state[name + "_blocks"], state[name + "_scales"], dtype=torch.float32
    )
    dequantized[name] = ref
  quantized = os.path.join(tmp_path, "mxfp4")
  os.makedirs(quantized)
  safetensors_torch.save_file(state, os.path.join(quantized, "model.safetensors"))
  cfg = json.load(open(os.path.join(hf_path, "config.json")))
  quantization = {"quantization_config": {"quant_method": "mxfp4"}}
  json.dump({**cfg, **quantization}, open(os.path.join(quantized, "config.json"), "w"))
  out, back = os.path.join(tmp_path, "mt"), os.path.join(tmp_path, "back")
  hf_to_maxtext.convert(quantized, out, scan_layers=False)
  maxtext_to_hf.convert(load(out, f"load_parameters_path={out}/params"), back, dtype="bfloat16")
  tensors = {}
  for name in set(json.load(open(os.path.join(back, "model.safetensors.index.json")))["weight_map"].values()):
    tensors |= safetensors_torch.load_file(os.path.join(back, name))
  for name, ref in dequantized.items():
    assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name].float(), ref), name
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
  tokens = TOKENS
  with torch.no_grad():
    ref = reloaded(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(maxtext_logits(out, tokens), ref, rtol=1e-5, atol=5e-5)
  with pytest.raises(ConfigError, match="quantization_config"):
    hf_keys({**cfg, "quantization_config": {"quant_method": "gptq"}})


def test_decode_with_the_cache_equals_the_full_forward():
  """Sinks and sliding windows (3 here) in the cache path: prefill and 4 steps past the window."""
  gpt_oss = ["decoder_block=gpt_oss", "base_num_decoder_layers=3", "num_experts=4", "num_experts_per_tok=2"]
  gpt_oss += ["sliding_window_size=3", "attention_sink=true", "attention_bias=true", "router_bias=true"]
  gpt_oss += ["mlp_bias=true", "mlp_activations_limit=1.5", "rope_type=yarn", "rope_truncate=false"]
  gpt_oss += ["original_max_position_embeddings=8", "rope_factor=4.0"]
  assert_cache_equals_forward(*gpt_oss)


def test_trains_on_the_quickstart_data(tmp_path):
  """A tiny gpt-oss (every option of the preset on) learns the quick-start corpus: the loss falls."""
  c = config.load(
    ["quickstart", "model_name=gpt-oss-20b", "override_model_config=true", f"base_output_directory={tmp_path}"]
    + ["run_name=gptoss", "base_emb_dim=64", "base_mlp_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2"]
    + ["head_dim=16", "base_num_decoder_layers=2", "num_experts=4", "num_experts_per_tok=2", "vocab_size=512"]
    + ["sliding_window_size=16", "max_target_length=32", "per_device_batch_size=1", "steps=20", "dtype=float32"]
    + ["text_max_documents=20", "enable_checkpointing=false", "eval_interval=0", "log_period=1"]
    + ["enable_tensorboard=false", "log_config=false", "load_balance_loss_weight=0.001"],
    {},
  )
  train.run(c)
  losses = [json.loads(line)["loss"] for line in open(c.metrics_file)]
  assert len(losses) == 20 and np.mean(losses[-5:]) < losses[0] - 0.5, losses


@pytest.mark.torch
@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_presets_are_the_released_configs(preset):
  """The preset -> config.json -> the same keys; transformers' GptOssConfig (its defaults are 120b's) maps
  to the preset; FLOPs count each sliding layer's 128-key window and each full layer's T/2 keys."""
  import transformers

  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", f"model_name={preset}"], {})
  hf = hf_config(c, "bfloat16")
  assert {k: v for k, v in hf_keys(hf).items() if c[k] != v} == {}
  layers, experts = (24, 32) if preset == "gpt-oss-20b" else (36, 128)
  released = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts).to_dict()
  keys = hf_keys(released)
  assert {k: v for k, v in keys.items() if c[k] != v} == {"load_balance_loss_weight": 0.001}
  with pytest.raises(ConfigError, match="layer_types"):
    hf_keys({**released, "layer_types": ["full_attention"] * layers})
  model = flops.abstract_model(c)
  per_layer = 2.0 * 64 * (64 + 64)  # 2 FLOPs x N heads x (H_qk + H_v) per attended key
  t = c.max_target_length
  window = flops.attended_keys(t, 128)
  want = layers // 2 * per_layer * (window + t / 2)
  assert flops.forward_count(model, t).attention == pytest.approx(want, rel=1e-9)


def test_sinks_need_dot_product_attention():
  base = [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", "model_name=gpt-oss-20b"]
  with pytest.raises(ConfigError, match="attention_sink=true runs with attention=dot_product"):
    planner.build(config.load([*base, "attention=flash"], {}))
  assert planner.build(config.load(base, {})).attention.kernel_for(4096) == "dot_product"
