"""Gemma 4 beyond families_test's parity: each distinctive feature switched off in our model only moves the logits
off transformers'; config.json features we do not support and other families' layouts are one-line errors; the
preset round-trips config.json (also from the released files' global_head_dim form) with transformers' RoPE;
kv-sharing layers match transformers, and do not when they attend to their own keys and values."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import config, planner, train
from MaxText.convert import hf_to_maxtext
from MaxText.errors import ConfigError
from MaxText.layers import moe, normalizations
from MaxText.layers.model_config import ModelConfig
from MaxText.models import gemma4
from MaxText.tests.conftest import losses
from MaxText.tests.helpers import (
  DECODE_FAMILIES,
  DECODE_TINY,
  FAMILIES,
  GEMMA4_KV_SHARED,
  TOKENS,
  T,
  assert_export_is_exact,
  converted_lora_chat_sft,
  hf_config,
  hf_keys,
  hf_model,
  layout_loss_and_grads,
  maxtext_logits,
)


def live_model(name, tmp):
  """The tiny random transformers model `name` (built as hf_references/make.py builds it), live, saved under
  tmp/hf: for the comparisons that change it or run it otherwise than the committed reference."""
  from MaxText.tests.hf_references import make

  model, path = make.build(name), os.path.join(tmp, "hf")
  model.save_pretrained(path)
  return model, path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  torch = pytest.importorskip("torch")
  """(HF logits on tokens, tokens, the converted model's directory, the HF directory); the HF model's per-layer
  scalars random and its logits 100 times larger, so that the scalars and the soft-cap count."""
  tmp = tmp_path_factory.mktemp("gemma4")
  model, hf_path = live_model("gemma4", tmp)
  with torch.no_grad():
    for name, b in model.named_buffers():
      if name.endswith("layer_scalar"):
        b.copy_(torch.rand_like(b) + 0.5)
    model.lm_head.weight.mul_(100.0)
  model.save_pretrained(hf_path)
  tokens = np.random.default_rng(0).integers(0, 64, (2, T))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).logits.numpy()
  out = os.path.join(tmp, "mt")
  hf_to_maxtext.convert(hf_path, out)
  np.testing.assert_allclose(maxtext_logits(out, tokens), ref, rtol=1e-5, atol=1e-5)
  return ref, tokens, out, hf_path


def unscaled_call(self, x, positions, segment_ids, rng, cache=None):
  return gemma4.DecoderLayer.__call__(self, x, positions, segment_ids, rng, cache)


def scaled_project(self, x, positions):
  q, k, v = ORIGINAL_PROJECT(self, x, positions)
  return q * q.shape[-1] ** -0.5, k, v


def unnormed_values(self, x):
  return x


ORIGINAL_PROJECT = gemma4.Gemma4Attention.project
SWITCHED_OFF = {
  "sliding_window": (["sliding_window_size=0"], None),
  "proportional_rope_on_full_layers": (["rope_type=default"], None),
  "sliding_layers_rope_base": (["local_rope_max_timescale=10000"], None),
  "final_logit_soft_cap": (["final_logits_soft_cap=0"], None),
  "full_attention_every_2nd_layer": (["full_attention_interval=4"], None),
  "layer_scalar": ([], (gemma4.Gemma4Layer, "__call__", unscaled_call)),
  "attention_scale_1": ([], (gemma4.Gemma4Attention, "project", scaled_project)),
  "value_norm": ([], (normalizations.UnitRMSNorm, "__call__", unnormed_values)),
  "norm_x_times_w": ([], (gemma4, "RMSNorm", normalizations.gemma_rms_norm)),
}


@pytest.mark.torch
@pytest.mark.parametrize("feature", sorted(SWITCHED_OFF))
def test_each_feature_switched_off_leaves_hugging_face(feature, converted, monkeypatch):
  ref, tokens, out, _ = converted
  overrides, patch = SWITCHED_OFF[feature]
  if patch is not None:
    monkeypatch.setattr(*patch)
  try:
    got = maxtext_logits(out, tokens, *overrides)
  except ValueError:  # the other layer pattern's parameters do not fit the checkpoint: as different as can be
    assert feature == "full_attention_every_2nd_layer"
    return
  assert np.abs(got - ref).max() > 1e-3, feature


@pytest.mark.torch
def test_unsupported_config_json_and_other_families_layouts_are_one_line_errors(converted, tmp_path):
  _, _, out, hf_path = converted
  hf = json.load(open(os.path.join(hf_path, "config.json")))
  rope = hf["rope_parameters"]
  bad = {
    "num_kv_shared_layers=3 must leave": {**hf, "num_kv_shared_layers": 3},
    "enable_moe_block=true needs num_experts, top_k_experts": {**hf, "enable_moe_block": True},
    "use_bidirectional_attention='all' is not supported": {**hf, "use_bidirectional_attention": "all"},
    "layer_types": {**hf, "layer_types": ["sliding_attention", "full_attention", "full_attention", "full_attention"]},
    "per_layer_config": {**hf, "per_layer_config": {"1": {"head_dim": 16}, "3": {"head_dim": 32}}},
    "factor=2.0 is not supported": {
      **hf, "rope_parameters": {**rope, "full_attention": {**rope["full_attention"], "factor": 2.0}}
    },
    "sliding_attention rope_type 'linear'": {
      **hf, "rope_parameters": {**rope, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}
    },
  }  # fmt: skip
  for message, cfg in bad.items():
    with pytest.raises(ConfigError, match=message) as e:
      hf_keys(cfg)
    assert "\n" not in str(e.value)
  # A Gemma 3 checkpoint read as Gemma 4's layout (config.json model_type gemma4_text).
  _, gemma3_path = hf_model("gemma3", tmp_path / "gemma3")
  cfg_path = os.path.join(gemma3_path, "config.json")
  gemma3 = json.load(open(cfg_path))
  as_gemma4 = {**gemma3, "model_type": "gemma4_text", "hidden_size_per_layer_input": 0, "per_layer_config": None}
  as_gemma4 |= {"layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]}
  json.dump(as_gemma4, open(cfg_path, "w"))
  with pytest.raises(ConfigError, match="layer_types") as e:
    hf_to_maxtext.convert(gemma3_path, os.path.join(tmp_path, "o"))
  assert "\n" not in str(e.value)
  json.dump({**as_gemma4, "num_hidden_layers": 6, "layer_types": None}, open(cfg_path, "w"))
  with pytest.raises(ConfigError, match="does not fit|Missing tensor") as e:
    hf_to_maxtext.convert(gemma3_path, os.path.join(tmp_path, "o2"))
  assert "\n" not in str(e.value)
  # kv-sharing layers whose unit would not start with a whole cycle, from the command line.
  tiny = [os.path.join(config.CONFIG_DIR, "base.yml"), *DECODE_TINY, *DECODE_FAMILIES["gemma4-kv-shared"]]
  with pytest.raises(ConfigError, match="num_kv_shared_layers=3 must leave") as e:
    planner.build(config.load([*tiny, "num_kv_shared_layers=3"], {}))
  assert "\n" not in str(e.value)
  tiny_moe = [os.path.join(config.CONFIG_DIR, "base.yml"), *DECODE_TINY, *DECODE_FAMILIES["gemma4-moe"]]
  for dense in ("first_num_dense_layers=2", "interleave_moe_layer_step=2"):  # not Gemma 4's MoE layout
    with pytest.raises(ConfigError, match="MoE block runs in every layer") as e:
      planner.build(config.load([*tiny_moe, dense], {}))
    assert "\n" not in str(e.value)
  # The converted MaxText checkpoint loaded with Gemma 3's decoder_block.
  with pytest.raises(ConfigError, match="load_parameters_path") as e:
    maxtext_logits(out, np.zeros((1, 4), np.int64), "decoder_block=gemma3")
  assert "\n" not in str(e.value)


@pytest.mark.torch
@pytest.mark.parametrize("preset", ["gemma4-31b", "gemma4-e2b", "gemma4-e4b", "gemma4-26b-a4b"])
def test_presets_export_their_config_and_read_it_back(preset):
  """Preset -> config.json -> the same keys, also from the released files' form (global_head_dim and
  num_global_key_value_heads in place of per_layer_config); RoPE per attention type as transformers computes it."""
  transformers = pytest.importorskip("transformers")
  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", f"model_name={preset}"], {})
  hf = hf_config(c, "bfloat16")
  assert {k: v for k, v in hf_keys(hf).items() if c[k] != v} == {}
  released = {k: v for k, v in hf.items() if k != "per_layer_config"}
  released |= {
    "global_head_dim": 512,
    "num_global_key_value_heads": c.global_num_kv_heads if c.attention_k_eq_v else None,
  }
  assert hf_keys(released) == hf_keys(hf)
  with pytest.raises(ConfigError, match="multiple of full_attention_interval"):
    hf_config(c.replace(base_num_decoder_layers=61), "bfloat16")
  hf_cfg = transformers.Gemma4TextConfig(
    **{k: v for k, v in released.items() if k not in ("model_type", "architectures")}
  )
  assert hf_cfg.layer_types == hf["layer_types"]
  rope = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(hf_cfg)
  mc = ModelConfig.from_config(c)
  full = gemma4.proportional_frequencies(512, mc.rope.partial_rotary_factor, mc.rope.rope_max_timescale)
  np.testing.assert_allclose(full, rope.full_attention_inv_freq.numpy(), rtol=1e-6)
  sliding = 1.0 / (mc.rope.local_rope_max_timescale ** (jnp.arange(0, 256, 2) / 256))
  np.testing.assert_allclose(sliding, rope.sliding_attention_inv_freq.numpy(), rtol=1e-6)


def own_kv_call(self, x, positions, segment_ids, rng, cache=None):
  """kv-sharing switched off: each sharing layer attends to keys/values that the layer it shares with would
  compute from the sharing layer's own input (its weights, this layer's hidden states)."""
  producers = {}
  for layer in self.sublayers:
    if layer.shares_kv:
      producer = producers[layer.full]
      kv = producer.self_attention.project(producer.pre_self_attention_layer_norm(x), positions)[1:]
    else:
      kv = None
      producers[layer.full] = layer
    x, _, _ = layer.run(x, positions, segment_ids, None, None, kv)
  return x, None


@pytest.mark.torch
@pytest.mark.slow  # 3 conversions, 5 models (70 s on the 2 busy cores); families_test's gemma4-ple is the quick check
def test_kv_sharing_layers_match_hugging_face_and_round_trip(tmp_path, monkeypatch):
  """The last 2 of 6 layers attend to layers 2's and 3's keys and values, with double-wide MLPs: logits equal
  transformers' (which runs kv-sharing without per-layer embeddings only with output_hidden_states), scan and
  unrolled; the export is bit-exact; a checkpoint that still holds the sharing layers' k_proj/v_proj/k_norm reads."""
  torch = pytest.importorskip("torch")
  from safetensors import torch as safetensors_torch

  monkeypatch.setitem(FAMILIES, "gemma4", ("Gemma4TextConfig", GEMMA4_KV_SHARED))
  model, hf_path = live_model("gemma4", tmp_path)
  tokens = np.random.default_rng(0).integers(0, 64, (2, T))
  with torch.no_grad():
    ref = model(torch.tensor(tokens), output_hidden_states=True).logits.numpy()
  scanned, unrolled = os.path.join(tmp_path, "scan"), os.path.join(tmp_path, "unrolled")
  hf_to_maxtext.convert(hf_path, scanned, scan_layers=True)
  hf_to_maxtext.convert(hf_path, unrolled, scan_layers=False)
  got = maxtext_logits(scanned, tokens)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(maxtext_logits(unrolled, tokens), got, rtol=1e-6, atol=1e-6)
  c = config.load([os.path.join(scanned, "config.yml"), "run_name=t", f"load_parameters_path={scanned}/params"], {})
  assert_export_is_exact(c, hf_path, os.path.join(tmp_path, "back"))
  monkeypatch.setattr(gemma4.SharedKVBlock, "__call__", own_kv_call)
  assert np.abs(maxtext_logits(scanned, tokens) - ref).max() > 1e-3
  monkeypatch.undo()
  weights = os.path.join(hf_path, "model.safetensors")
  tensors = safetensors_torch.load_file(weights)
  tensors["model.layers.5.self_attn.k_proj.weight"] = torch.zeros(16, 32)
  tensors["model.layers.4.self_attn.k_norm.weight"] = torch.zeros(8)
  safetensors_torch.save_file(tensors, weights, metadata={"format": "pt"})
  hf_to_maxtext.convert(hf_path, os.path.join(tmp_path, "with_unused"))
  np.testing.assert_allclose(maxtext_logits(os.path.join(tmp_path, "with_unused"), tokens), got, rtol=0, atol=0)


def only_tokens(self, tokens, x):
  return ORIGINAL_PER_LAYER(self, tokens, jnp.zeros_like(x)) * 2.0**0.5


ORIGINAL_PER_LAYER = gemma4.PerLayerInputs.__call__
PER_LAYER_OFF = {
  "per_layer_inputs": lambda self, tokens, x: jnp.zeros((self.layers, *tokens.shape, self.dim), x.dtype),
  "per_layer_projection_of_the_embeddings": only_tokens,
}


@pytest.mark.slow  # 37 s on the 2 busy cores
def test_per_layer_embeddings_switched_off_leave_hugging_face(tmp_path, monkeypatch):
  """gemma4-ple (kv-sharing and per-layer embeddings) matches transformers (families_test); without the per-layer
  inputs, or with their token part alone, it does not."""
  reference, hf_path = hf_model("gemma4-ple", tmp_path)
  tokens, ref = TOKENS, reference.logits
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  np.testing.assert_allclose(maxtext_logits(out, tokens), ref, rtol=1e-5, atol=1e-5)
  for feature, call in PER_LAYER_OFF.items():
    with monkeypatch.context() as m:
      m.setattr(gemma4.PerLayerInputs, "__call__", call)
      assert np.abs(maxtext_logits(out, tokens) - ref).max() > 1e-3, feature


def unscaled_route_input(self, x):
  unit = normalizations.UnitRMSNorm(x.shape[-1], epsilon=1e-6, dtype=x.dtype, weight_dtype=x.dtype)
  return unit(x) * x.shape[-1] ** -0.5


def experts_without(norm):
  """Gemma4MoE's call with its `norm` ("pre_norm" or "post_norm") left out."""

  def call(self, x):
    h = x if norm == "pre_norm" else self.pre_norm(x)
    h = self.experts(h, route_from=self.route_input(x))
    return h if norm == "post_norm" else self.post_norm(h)

  return call


def feed_forward_without_post_mlp_norm(self, x):
  return self.post_ffw_norm(self.mlp(self.post_self_attention_layer_norm(x)) + self.moe(x))


MOE_OFF = {
  "router_scale": (gemma4.Gemma4MoE, "route_input", unscaled_route_input),
  "per_expert_scale": (moe, "per_expert_weights", lambda weights, experts, scale: weights),
  "pre_experts_norm": (gemma4.Gemma4MoE, "__call__", experts_without("pre_norm")),
  "post_experts_norm": (gemma4.Gemma4MoE, "__call__", experts_without("post_norm")),
  "post_mlp_norm": (gemma4.Gemma4Layer, "feed_forward", feed_forward_without_post_mlp_norm),
  "experts": (gemma4.Gemma4MoE, "__call__", lambda self, x: jnp.zeros_like(x)),
}


@pytest.mark.slow  # one conversion, 7 compiles (about a minute on the 2 busy cores); families_test is the quick check
def test_moe_features_switched_off_leave_hugging_face(tmp_path, monkeypatch):
  """gemma4-moe (the MoE block beside each dense MLP) matches transformers (families_test); without the router's
  scale, the per-expert scales, any of the three extra norms, or the experts at all, it does not."""
  reference, hf_path = hf_model("gemma4-moe", tmp_path)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  np.testing.assert_allclose(maxtext_logits(out, TOKENS), reference.logits, rtol=1e-5, atol=1e-5)
  for feature, patch in MOE_OFF.items():
    with monkeypatch.context() as m:
      m.setattr(*patch)
      assert np.abs(maxtext_logits(out, TOKENS) - reference.logits).max() > 1e-3, feature


@pytest.mark.nightly  # a converted checkpoint trains: conftest.NIGHTLY
@pytest.mark.slow  # LoRA SFT of a converted model: a minute or more on the 2 busy cores
@pytest.mark.parametrize("family", ["gemma4-ple", "gemma4-moe"])
def test_lora_sft_on_the_converted_model_trains(family, tmp_path, monkeypatch):
  """A converted tiny Gemma 4 with kv-sharing and per-layer embeddings, or with the MoE block (vocab widened to the
  chat tokenizer's), fine-tunes with LoRA on chat data: the loss falls."""
  c = converted_lora_chat_sft(family, tmp_path)
  train.run(c, jax.devices()[:1])
  got = losses(c)
  assert len(got) == 4 and all(np.isfinite(got)) and got[-1] < got[0], got


# Each layout with the bound on a gradient's difference, as a fraction of its leaf's largest gradient. Under data x
# fsdp x tensor the per-layer inputs (RMS-normed over only P = 4 dims here) spread the summation-order differences
# to ~5e-4 of a leaf (2e-4 without them: hidden_size_per_layer_input=0).
# Both layouts shard over fsdp too (2 and 4 devices): plain fsdp over 8 would add a compile and check nothing new.
LAYOUTS = [
  (["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], 1e-3),
  (["ici_fsdp_parallelism=4", "ici_context_parallelism=2"], 2e-4),  # windows and shared keys across context shards
]


# The MoE block (gemma4-moe): its 4 experts split over expert=4 and expert=2 (with data and tensor).
MOE_LAYOUTS = [
  (["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"], 2e-4),
  (["ici_data_parallelism=2", "ici_expert_parallelism=2", "ici_tensor_parallelism=2"], 1e-3),
]


@pytest.mark.slow  # compiles 3 layouts (one device and two over 8 CPU devices)
@pytest.mark.parametrize("family, layouts", [("gemma4-kv-shared", LAYOUTS), ("gemma4-moe", MOE_LAYOUTS)])
def test_layouts_give_the_single_device_loss_and_gradients(family, layouts):
  """data x fsdp x tensor and fsdp x context on 8 CPU devices: the loss and its gradients of a tiny Gemma 4
  with kv-sharing layers and per-layer embeddings equal one device's; with the MoE block, under expert
  parallelism too."""
  tiny = [os.path.join(config.CONFIG_DIR, "base.yml"), *DECODE_TINY, *DECODE_FAMILIES[family]]
  tiny += ["global_num_kv_heads=2"]  # kv heads that split over tensor=2
  want_loss, want_grads = layout_loss_and_grads(tiny)
  for layout, bound in layouts:
    got_loss, got_grads = layout_loss_and_grads(tiny, *layout, devices=8)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, err_msg=str(layout))
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):  # float32 summation order only:
      scale = np.abs(np.asarray(w)).max()  # up to ~1e-4 of a leaf's largest gradient (sums over 8 devices); a
      # layer_scalar's gradient [n, 1] is one sum over B x T x D that mostly cancels: 1e-2 of it
      rtol = 1e-2 if np.asarray(w).size <= 2 else 1e-4
      atol = max(1e-6, bound * scale)
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol, err_msg=str(layout))
