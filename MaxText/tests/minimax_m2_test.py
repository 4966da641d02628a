"""MiniMax M2 against transformers' MiniMaxM2ForCausalLM beyond families_test's parity: each distinctive
feature switched off in our model alone breaks the match; greedy tokens without the KV cache; bad input."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, planner, train
from MaxText.convert import hf_to_maxtext
from MaxText.errors import ConfigError
from MaxText.layers import normalizations
from MaxText.tests.conftest import BASE, cfg, losses
from MaxText.tests.helpers import (
  LORA,
  PROMPTS,
  TOKENS,
  hf_config,
  hf_keys,
  hf_model,
  load_converted,
  make_tokenizer,
  maxtext_logits,
  write_jsonl,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF reference outputs, its directory, the converted MaxText directory, tokens [2, T], HF logits)."""
  tmp = tmp_path_factory.mktemp("minimax")
  reference, hf_path = hf_model("minimax-m2", tmp)
  out = os.path.join(tmp, "mt")
  hf_to_maxtext.convert(hf_path, out)
  return reference, hf_path, out, TOKENS, reference.logits


# The release's FP8 block scaling (dequantized on import, convert/fp8.py).
RELEASE_FP8 = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128]}
RELEASE_FP8 |= {"activation_scheme": "dynamic", "modules_to_not_convert": ["gate", "e_score_correction_bias"]}


def mismatch(got, ref):
  return np.max(np.abs(got - ref)) > 1e-3


@pytest.mark.parametrize(
  "override",
  [
    "routed_bias=false",  # experts chosen by the sigmoid scores alone
    "routed_score_func=softmax",
    "norm_topk_prob=false",
    "partial_rotary_factor=1.0",  # RoPE over whole heads
  ],
)
def test_each_feature_switched_off_breaks_parity(converted, override):
  _, _, out, tokens, ref = converted  # families_test checks that the logits match with every feature on
  if override == "routed_bias=false":  # the checkpoint holds the bias: zero it instead of dropping the parameter
    model = load_converted(out)
    model.layers.mlp.gate_bias[...] = jnp.zeros_like(model.layers.mlp.gate_bias[...])
    b, t = tokens.shape
    got = np.asarray(model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)))
  else:
    got = maxtext_logits(out, tokens, override)
  assert mismatch(got, ref), override


def test_qk_norm_per_head_instead_of_across_heads_breaks_parity(converted, monkeypatch):
  _, _, out, tokens, ref = converted

  def per_head(self, x):  # the same weights, each head normalised on its own (Qwen3's q/k norm)
    x32 = x.astype(jnp.float32)
    y = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return (y * self.scale[...].reshape(x.shape[-2:])).astype(self.dtype)

  monkeypatch.setattr(normalizations.HeadsRMSNorm, "__call__", per_head)
  assert mismatch(maxtext_logits(out, tokens), ref)


def test_greedy_without_cache_equals_hugging_face(converted):
  """16 greedy tokens by whole forward passes (no cache) over the growing sequence, right-padded to a fixed
  width (causal: the padding after a position does not change its logits)."""
  reference, _, out, _, _ = converted
  graphdef, state = nnx.split(load_converted(out))
  width = 32
  forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, jnp.arange(width)[None], jnp.ones((1, width), jnp.int32)))
  prompt = PROMPTS[1]
  seq = np.zeros((1, width), np.int32)
  seq[0, : len(prompt)] = prompt
  for t in range(len(prompt), len(prompt) + 16):
    seq[0, t] = int(jnp.argmax(forward(state, jnp.asarray(seq))[0, t - 1]))
  np.testing.assert_array_equal(seq[0, len(prompt) : len(prompt) + 16], reference.greedy[1])  # the longest: unpadded


def test_unsupported_config_fields_and_other_families_fail_in_one_line(converted, tmp_path):
  _, hf_path, _, _, _ = converted
  cfg = json.load(open(os.path.join(hf_path, "config.json")))
  for field, value, match in (
    ("scoring_func", "softmax", "scoring_func='softmax' is not supported"),
    ("use_routing_bias", False, "use_routing_bias=False is not supported"),
    ("qk_norm_type", "per_head", "qk_norm_type='per_head' is not supported"),
    ("shared_intermediate_size", 512, "shared_intermediate_size=512 is not supported"),
    ("attn_type_list", [0, 1], "lightning"),
  ):
    with pytest.raises(ConfigError, match=match):
      hf_keys({**cfg, field: value})
  published = {"rope_theta": 5e6, "rotary_dim": 2, "quantization_config": RELEASE_FP8}
  keys = hf_keys({k: v for k, v in cfg.items() if k != "rope_parameters"} | published)
  assert keys["partial_rotary_factor"] == 0.25 and keys["rope_max_timescale"] == 5e6  # the published form
  # This checkpoint read as Mixtral (same expert names): the bias and q/k norms do not fit, named in one line.
  as_mixtral = os.path.join(tmp_path, "as_mixtral")
  os.makedirs(as_mixtral)
  os.link(os.path.join(hf_path, "model.safetensors"), os.path.join(as_mixtral, "model.safetensors"))
  json.dump({**cfg, "model_type": "mixtral"}, open(os.path.join(as_mixtral, "config.json"), "w"))
  with pytest.raises(ConfigError, match=r"Tensor model\.layers\.0\.block_sparse_moe\.e_score_correction_bias .*fit"):
    hf_to_maxtext.convert(as_mixtral, os.path.join(tmp_path, "o1"))


def test_mixtral_checkpoint_given_minimax_config_names_the_missing_tensor(tmp_path):
  _, hf_path = hf_model("mixtral", tmp_path)
  cfg = json.load(open(os.path.join(hf_path, "config.json")))
  json.dump({**cfg, "model_type": "minimax_m2"}, open(os.path.join(hf_path, "config.json"), "w"))
  with pytest.raises(ConfigError, match=r"Missing tensor model\.layers\.0\..*(e_score_correction_bias|norm)"):
    hf_to_maxtext.convert(hf_path, os.path.join(tmp_path, "mt"))


def test_export_writes_rotary_dim_and_refuses_a_router_the_class_cannot_run():
  base = [BASE, "run_name=t"]
  keys = ["decoder_block=minimax_m2", "num_experts=4", "num_experts_per_tok=2", "use_qk_norm=true"]
  c = config.load([*base, *keys, "routed_score_func=sigmoid", "routed_bias=true", "partial_rotary_factor=0.5"], {})
  out = hf_config(c, "float32")
  assert out["rotary_dim"] == c.head_dim // 2 and out["rope_parameters"]["partial_rotary_factor"] == 0.5
  with pytest.raises(ConfigError, match="routed_bias=true"):
    hf_config(config.load([*base, *keys, "routed_score_func=sigmoid"], {}), "float32")
  with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 has no Hugging Face export for llama2"):
    hf_config(config.load([*base, "decoder_block=llama2", "partial_rotary_factor=0.5"], {}), "float32")
  with pytest.raises(ConfigError, match="partial_rotary_factor=0.3 must rotate an even number"):
    planner.build(config.load([*base, *keys, "partial_rotary_factor=0.3"], {}))  # before anything is built


def test_preset_exports_the_published_config_and_reads_it_back():
  c = config.load([BASE, "run_name=t", "model_name=minimax-m2-230b"], {})
  out = hf_config(c, "bfloat16")
  assert out["rotary_dim"] == 64 and out["num_local_experts"] == 256 and out["model_type"] == "minimax_m2"
  keys = hf_keys(out)
  for key, value in keys.items():
    assert c[key] == value, key


@pytest.mark.nightly  # a converted checkpoint trains: conftest.NIGHTLY
@pytest.mark.slow  # about 60 s on 2 busy cores
def test_converted_model_fine_tunes_with_lora_and_sft(tmp_path):
  """The converted model (vocabulary widened to the chat tokenizer's ids) trains under LoRA, then under SFT on
  chat data."""
  _, hf_path = hf_model("minimax-m2", tmp_path, vocab_size=320)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  tok = make_tokenizer(str(tmp_path / "tok"))
  data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is it?", "completion": "Paris."}] * 8)
  common = [os.path.join(out, "config.yml"), f"base_output_directory={tmp_path}", f"load_parameters_path={out}/params"]
  common += ["steps=2", "max_target_length=32", "per_device_batch_size=1", "enable_checkpointing=false"]
  common += ["log_period=1", "dtype=float32", "tokenizer_type=huggingface", f"tokenizer_path={tok.path}"]
  for name, extra in (("lora", ["dataset_type=synthetic", *LORA]), ("sft", ["dataset_type=text", "use_sft=true"])):
    c = config.load([*common, f"run_name={name}", *extra, f"dataset_path={data}", "eval_fraction=0"], {})
    train.run(c)
    assert len(losses(c)) == 2 and all(np.isfinite(losses(c))), name


# The family at TINY's sizes with 8 experts (top-2) and a bias nudged each step, so routing is live.
MINIMAX_TINY = ["decoder_block=minimax_m2", "num_experts=8", "num_experts_per_tok=2", "use_qk_norm=true"]
MINIMAX_TINY += ["routed_score_func=sigmoid", "routed_bias=true", "partial_rotary_factor=0.5", "steps=3"]
MINIMAX_TINY += ["routed_bias_update_rate=0.01", "per_device_batch_size=2"]


@pytest.mark.slow  # three short runs, about 27 s on 2 cores
def test_losses_equal_across_layouts_on_eight_devices(tmp_path):
  """Global batch 16: expert parallel (the experts over 2 or 8 devices, tokens moved by all-to-all), tensor
  parallel (heads split: the q/k norms reduce across devices) give fsdp's losses; expert, tensor and fsdp at once."""
  ref = run(tmp_path, "fsdp8", "ici_fsdp_parallelism=8")
  others = {
    "ep2-tp2-fsdp2": run(
      tmp_path, "ep2tp2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"
    ),
    "ep8": run(tmp_path, "ep8", "ici_expert_parallelism=8", "ici_fsdp_parallelism=1"),
  }
  for name, got in others.items():
    np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=name)


def run(tmp_path, name, *overrides, devices=None):
  c = cfg(tmp_path, name, *MINIMAX_TINY, *overrides)
  train.run(c, devices)
  return losses(c)


def test_flops_of_the_preset_count_eight_routed_experts_and_the_router():
  """Per layer: q, k, v, o (3072 x (6144 + 2 x 1024) + 6144 x 3072), the router (3072 x 256) and 8 experts
  (3 x 3072 x 1536 each), 6 FLOPs per weight per token in training, over 62 layers."""
  from MaxText import flops  # noqa: PLC0415

  c = config.load([BASE, "run_name=t", "model_name=minimax-m2-230b", "max_target_length=4096"], {})
  per_layer = 3072 * (6144 + 2 * 1024) + 6144 * 3072 + 3072 * 256 + 8 * 3 * 3072 * 1536
  assert flops.training_flops_per_token(c).matmul == 6 * 62 * per_layer


@pytest.mark.nightly  # a family's stack pipelines: conftest.NIGHTLY
@pytest.mark.slow  # two short runs, about 125 s on 2 busy cores
def test_pipeline_stages_give_fsdp_losses(tmp_path):
  """Four layers over 2 pipeline stages (the bias fixed: its load-driven update is refused under pipelining)."""
  fixed = ["routed_bias_update_rate=0", "base_num_decoder_layers=4"]
  ref = run(tmp_path, "fsdp8", *fixed, "ici_fsdp_parallelism=8")
  got = run(tmp_path, "pp2", *fixed, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4")
  np.testing.assert_allclose(got, ref, rtol=1e-5)
