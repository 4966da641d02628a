"""OLMo 3 beyond families_test's parity: each distinctive feature switched off in our model only moves the logits
off transformers'; config.json features we do not support and other families' layouts are one-line errors; the
presets round-trip config.json with transformers' RoPE; FLOPs count the windows; (slow) LoRA SFT on the converted
model trains, and sharded layouts give one device's loss and gradients."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import config, flops, models, train
from MaxText.convert import hf_to_maxtext
from MaxText.errors import ConfigError
from MaxText.layers import embeddings, normalizations
from MaxText.layers.decoder import Family, alternating_stacks
from MaxText.layers.model_config import ModelConfig
from MaxText.models import olmo3
from MaxText.tests.conftest import losses
from MaxText.tests.helpers import (
  DECODE_FAMILIES,
  DECODE_TINY,
  TOKENS,
  converted_lora_chat_sft,
  hf_config,
  hf_keys,
  hf_model,
  layout_loss_and_grads,
  maxtext_logits,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF logits on tokens, tokens, the converted model's directory, the HF directory)."""
  tmp = tmp_path_factory.mktemp("olmo3")
  reference, hf_path = hf_model("olmo3", tmp)
  tokens, ref = TOKENS, reference.logits
  out = os.path.join(tmp, "mt")
  hf_to_maxtext.convert(hf_path, out)
  np.testing.assert_allclose(maxtext_logits(out, tokens), ref, rtol=1e-5, atol=1e-5)
  return ref, tokens, out, hf_path


def per_head_norm(self, x):
  """The q/k norm over each head alone (Qwen3's), with OLMo 3's scales."""
  x32 = x.astype(jnp.float32)
  y = x32 * (jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon) ** -0.5
  return (y * self.scale[...].reshape(x.shape[-2:])).astype(self.dtype)


def pre_norm_call(self, x, positions, segment_ids, rng, cache=None):
  """The norms before the sublayers (Llama's placement), with OLMo 3's weights."""
  h, cache = self.self_attention(self.post_self_attention_norm(x), positions, segment_ids, None, cache)
  x = x + h
  return x + self.mlp(self.post_ffw_norm(x)), cache


def all_sliding(config):
  """Layer 3 local too: four sliding-window layers per block."""
  return alternating_stacks(config, (olmo3._sliding,) * 4)


def yarn_everywhere(config, *, rngs, plan):
  """Sliding layers with the full layers' RoPE scaling (their own base kept)."""
  local = config.rope.local_rope_max_timescale
  return olmo3.PostNormLayer(config, rngs=rngs, plan=plan, rope_max_timescale=local)


SWITCHED_OFF = {
  "sliding_window": (["sliding_window_size=0"], None),
  "yarn_on_full_layers": (["rope_type=default"], None),
  "plain_rope_on_sliding_layers": ([], ("_sliding", yarn_everywhere)),
  "full_attention_every_4th_layer": ([], ("registry", all_sliding)),
  "qk_norm_across_heads": ([], ("norm", per_head_norm)),
  "post_norm": ([], ("layer", pre_norm_call)),
}


@pytest.mark.parametrize("feature", sorted(SWITCHED_OFF))
def test_each_feature_switched_off_leaves_hugging_face(feature, converted, monkeypatch):
  ref, tokens, out, _ = converted
  overrides, patch = SWITCHED_OFF[feature]
  if patch is not None:
    what, value = patch
    if what == "_sliding":
      monkeypatch.setattr(olmo3, "_sliding", value)
    elif what == "registry":
      monkeypatch.setitem(models.REGISTRY, "olmo3", Family(stacks=value))
    elif what == "norm":
      monkeypatch.setattr(normalizations.HeadsRMSNorm, "__call__", value)
    else:
      monkeypatch.setattr(olmo3.PostNormLayer, "__call__", value)
  got = maxtext_logits(out, tokens, *overrides)
  assert np.abs(got - ref).max() > 1e-3, feature


def test_unsupported_config_json_and_other_families_layouts_are_one_line_errors(converted, tmp_path):
  _, _, out, hf_path = converted
  hf = json.load(open(os.path.join(hf_path, "config.json")))
  bad = {
    "layer_types": {**hf, "layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]},
    "needs a sliding_window": {**hf, "sliding_window": None},
    "sliding_attention rope_type 'linear'": {
      **hf,
      "rope_parameters": {**hf["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
    },  # fmt: skip
  }
  for message, cfg in bad.items():
    with pytest.raises(ConfigError, match=message) as e:
      hf_keys(cfg)
    assert "\n" not in str(e.value)
  # An OLMo 3 checkpoint read as Llama's layout (config.json model_type llama): its post-sublayer norms have no place.
  llama = os.path.join(tmp_path, "as_llama")
  os.makedirs(llama)
  for name in os.listdir(hf_path):
    os.symlink(os.path.join(hf_path, name), os.path.join(llama, name)) if name != "config.json" else None
  json.dump({**hf, "model_type": "llama", "rope_parameters": hf["rope_parameters"]["full_attention"]},
            open(os.path.join(llama, "config.json"), "w"))  # fmt: skip
  with pytest.raises(ConfigError, match=r"post_feedforward_layernorm\.weight \(and 14 more\) does not fit") as e:
    hf_to_maxtext.convert(llama, os.path.join(tmp_path, "o"))
  assert "\n" not in str(e.value)
  # A Llama checkpoint read as OLMo 3's layout (config.json model_type olmo3).
  _, llama_path = hf_model("llama2", tmp_path / "llama")
  cfg_path = os.path.join(llama_path, "config.json")
  json.dump({**json.load(open(cfg_path)), "model_type": "olmo3", "sliding_window": 4}, open(cfg_path, "w"))
  with pytest.raises(ConfigError, match="input_layernorm.weight .* does not fit|Missing tensor") as e:
    hf_to_maxtext.convert(llama_path, os.path.join(tmp_path, "o2"))
  assert "\n" not in str(e.value)
  # The converted MaxText checkpoint loaded with Llama 2's decoder_block.
  with pytest.raises(ConfigError, match="load_parameters_path") as e:
    maxtext_logits(out, np.zeros((1, 4), np.int64), "decoder_block=llama2")
  assert "\n" not in str(e.value)


@pytest.mark.torch
@pytest.mark.parametrize("preset", ["olmo3-7b", "olmo3-32b"])
def test_presets_export_their_config_and_read_it_back(preset):
  """Preset -> config.json -> the same keys, also from the released files' legacy form (rope_theta with a
  rope_scaling for the full layers); RoPE per attention type as transformers computes it for that config.json."""
  transformers = pytest.importorskip("transformers")
  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", f"model_name={preset}"], {})
  hf = hf_config(c, "bfloat16")
  assert {k: v for k, v in hf_keys(hf).items() if c[k] != v} == {}
  full = dict(hf["rope_parameters"]["full_attention"])
  legacy = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
  legacy |= {"rope_theta": full.pop("rope_theta"), "rope_scaling": full}
  assert hf_keys(legacy) == hf_keys(hf)
  with pytest.raises(ConfigError, match="sliding_window_size > 0"):
    hf_config(c.replace(sliding_window_size=0), "bfloat16")
  hf_cfg = transformers.Olmo3Config(**{k: v for k, v in legacy.items() if k not in ("model_type", "architectures")})
  assert hf_cfg.layer_types == hf["layer_types"]
  rope = transformers.models.olmo3.modeling_olmo3.Olmo3RotaryEmbedding(hf_cfg)
  mc = ModelConfig.from_config(c)
  for kind, theta, rope_type in (
    ("full", c.rope_max_timescale, "yarn"),
    ("sliding", c.local_rope_max_timescale, "default"),
  ):
    ours = embeddings.scaled_rope_frequencies(mc, c.head_dim, theta, rope_type)
    np.testing.assert_allclose(ours, getattr(rope, f"{kind}_attention_inv_freq").numpy(), rtol=1e-6)
    factor = getattr(rope, f"{kind}_attention_attention_scaling")
    assert embeddings.rope_attention_factor(mc, rope_type) == pytest.approx(factor, rel=1e-12)


@pytest.mark.nightly  # a converted checkpoint trains: conftest.NIGHTLY
@pytest.mark.slow  # 135 s on the 2 busy cores (2026-11-27)
def test_lora_sft_on_the_converted_model_trains(tmp_path):
  """A converted tiny OLMo 3 (vocab widened to the chat tokenizer's) fine-tunes with LoRA on chat data: only the
  adapters train and the loss falls."""
  c = converted_lora_chat_sft("olmo3", tmp_path)
  train.run(c, jax.devices()[:1])
  got = losses(c)
  assert len(got) == 4 and all(np.isfinite(got)) and got[-1] < got[0], got


# Both layouts shard over fsdp too (2 and 4 devices): plain fsdp over 8 would add a compile and check nothing new.
LAYOUTS = [
  ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
  ["ici_fsdp_parallelism=4", "ici_context_parallelism=2"],  # sliding windows across context shards
]


@pytest.mark.slow  # 3 compiles: one device, then 2 layouts on 8
def test_layouts_give_the_single_device_loss_and_gradients():
  """data x fsdp x tensor and fsdp x context on 8 CPU devices: the loss and its gradients of a tiny
  OLMo 3 (sliding layers of window 3 over 16 tokens, q/k norms across sharded heads) equal one device's."""
  tiny = [os.path.join(config.CONFIG_DIR, "base.yml"), *DECODE_TINY, *DECODE_FAMILIES["olmo3"]]
  want_loss, want_grads = layout_loss_and_grads(tiny)
  for layout in LAYOUTS:
    got_loss, got_grads = layout_loss_and_grads(tiny, *layout, devices=8)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, err_msg=str(layout))
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6, err_msg=str(layout))


def test_flops_count_the_sliding_layers_window():
  """olmo3-7b at 8192 tokens: 24 layers attend within 4096 keys (3072 per query on average), 8 to the prefix."""
  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", "model_name=olmo3-7b"], {})
  count = flops.forward_count(flops.abstract_model(c), 8192)
  per_key = 2.0 * 32 * (128 + 128)  # QK^T and AV over 32 heads of 128
  assert flops.attended_keys(8192, 4096) == 3072
  assert count.attention == pytest.approx(per_key * (24 * 3072 + 8 * 4096), rel=1e-12)
