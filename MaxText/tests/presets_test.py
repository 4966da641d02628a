"""Every preset (models/<family>/presets/) loads, builds abstractly (jax.eval_shape, nothing allocated) and
has the published parameter count within 1%."""

import glob
import os

import jax
import pytest
from flax import nnx

from MaxText import config, models, planner
from MaxText.errors import ConfigError

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
PUBLISHED = {  # billions of parameters, as published by the model authors (text decoder only)
  "llama2-7b": 6.74,
  "llama2-13b": 13.0,
  "llama2-70b": 69.0,
  "llama3-8b": 8.03,
  "llama3-70b": 70.6,
  "llama3.1-8b": 8.03,
  "llama3.1-70b": 70.6,
  "llama3.1-405b": 405.9,
  "mistral-7b": 7.24,
  "mixtral-8x7b": 46.7,
  "mixtral-8x22b": 140.6,
  "gemma-2b": 2.51,
  "gemma-7b": 8.54,
  "gemma2-2b": 2.61,
  "gemma2-9b": 9.24,
  "gemma2-27b": 27.2,
  "gemma3-4b": 3.88,
  "gemma3-12b": 11.8,
  "gemma3-27b": 27.0,
  "qwen3-0.6b": 0.60,
  "qwen3-4b": 4.02,
  "qwen3-8b": 8.19,
  "qwen3-14b": 14.8,
  "qwen3-32b": 32.8,
  "qwen3-30b-a3b": 30.5,
  "deepseek2-16b": 15.7,
  "deepseek3-671b": 671.0,
  "deepseek32-671b": 671.0,  # V3 + 0.85B of indexers; DeepSeek counts it as V3 (685B with the MTP module)
  # Kimi K2: its config.json as transformers counts it (1,026,408,209,408 on the meta device, plus our 23,040
  # router biases, a buffer there); the tech report's "1.04T" is 1.3% above that.
  "kimi-k2-1t": 1026.4,
  "gpt3-175b": 175.0,
  "llama4-17b-16e": 107.8,  # Scout: 109B published with the vision encoder; the text decoder from its config.json
  "llama4-17b-128e": 400.7,  # Maverick: 400B published
  # gpt-oss: transformers' count of the released config.json (20,914,757,184 and 116,829,156,672; 21B and 117B
  # published)
  "gpt-oss-20b": 20.91,
  "gpt-oss-120b": 116.83,
  "qwen3-next-80b-a3b": 79.67,  # 80B published; transformers counts 79,674,391,296 for its config.json
  # GLM-4.5: transformers' count of the released config.json plus our router biases (a buffer there), no MTP layer
  "glm4.5-355b-a32b": 352.80,  # 355B published (with the MTP layer)
  "glm4.5-air-106b-a12b": 106.85,
  # OLMo 3: transformers' count of the presets' config.json (7,298,011,136 and 32,233,522,176; 7B and 32B published)
  "olmo3-7b": 7.30,
  "olmo3-32b": 32.23,
  "minimax-m2-230b": 228.69,  # 230B published; transformers counts 228,689,748,992 (+ 15,872 router biases)
  # Qwen3.5-MoE text models (35B, 122B, 397B published with the vision tower): transformers' count of the presets'
  # Qwen3_5MoeTextConfig, 34,660,610,688, 122,111,526,912 and 396,346,350,336, equals ours
  "qwen3.5-35b-a3b": 34.66,
  "qwen3.5-122b-a10b": 122.11,
  "qwen3.5-397b-a17b": 396.35,
  # dense Qwen3.5 text models (27B and 9B published with the vision tower): transformers' count of the presets'
  # Qwen3_5TextConfig, 26,895,998,464 and 8,953,803,264, equals ours
  "qwen3.5-27b": 26.90,
  "qwen3.5-9b": 8.95,
  # Gemma 4 text decoders: transformers' count of the presets' config.json, 30,697,345,280, 4,628,569,344 and
  # 7,463,013,376 (31B, and E2B/E4B's 5.1B/8B with their audio and vision towers, published); ours adds the
  # per-layer scalars (a buffer there)
  "gemma4-31b": 30.70,
  "gemma4-e2b": 4.63,
  "gemma4-e4b": 7.46,
  # Gemma 4 26B-A4B (25.2B total, 3.8B active published): transformers' count of the preset's config.json,
  # 25,233,141,760, plus our 30 per-layer scalars; 3.82B active (8 of 128 experts per layer)
  "gemma4-26b-a4b": 25.23,
}


def num_params(name: str) -> int:
  c = config.load([BASE, "run_name=t", f"model_name={name}"], {})
  model = nnx.eval_shape(lambda: models.build(c, nnx.Rngs(params=0), planner.build(c)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_every_preset_has_a_published_count():
  assert set(config.presets()) - {"default"} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count(name):
  assert num_params(name) / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01)


@pytest.mark.parametrize(
  "bad",
  [
    "sliding_window_size=-1",
    "rope_type=dynamic",
    "rope_type=yarn rope_beta_slow=0",
    "rope_type=yarn rope_beta_fast=-1",
    "rope_type=yarn rope_beta_fast=0.5",
    "rope_mscale=-1",
    "num_experts=8 num_experts_per_tok=3 n_routing_groups=4",
    "routed_group_score=mean",
    "num_experts_per_tok=3",
    "num_experts=6 n_routing_groups=4",
    "routed_score_func=relu",
    "first_num_dense_layers=99",
    "mlp_activations_limit=-1",
    "decoder_block=deepseek attention_bias=true",
    "chunk_attn_window_size=-1",
    "chunk_attn_window_size=8 sliding_window_size=8",
    "interleave_moe_layer_step=0",
    "num_experts=4 num_experts_per_tok=2 routed_weight_on_input=true",
  ],
)
def test_family_options_are_validated(bad):
  with pytest.raises(ConfigError):
    config.load([BASE, "run_name=t", "num_experts=2", *bad.split()], {})


def test_each_preset_sits_in_the_folder_of_its_family():
  """models/<decoder_block>/presets/<model_name>.yml, names unique across folders; every folder with a
  Hugging Face mapping is a registered decoder_block."""
  files = glob.glob(os.path.join(config.MODELS_DIR, "*", "presets", "*.yml"))
  assert len(files) == len(config.presets())
  for name, path in config.presets().items():
    block = config.load([BASE, "run_name=t", f"model_name={name}"], {}).decoder_block
    assert os.path.basename(os.path.dirname(os.path.dirname(path))) == block, name
  assert set(models.HF) == set(models.REGISTRY) - {"default"}
  assert all(block == mapping.decoder_block for block, mapping in models.HF.items())
