"""Model families, one folder each (models/<family>/: its description, Hugging Face mapping and presets):
a plain dict from decoder_block to the family's description (layers/decoder.Family), and one to its
Hugging Face mapping (convert/hf_mapping.Mapping)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flax import nnx

from MaxText.convert.hf_mapping import Mapping
from MaxText.layers import lora
from MaxText.layers.decoder import Decoder, Family
from MaxText.layers.model_config import ModelConfig
from MaxText.models import (
  deepseek,
  gemma,
  gemma2,
  gemma3,
  gemma4,
  glm4_moe,
  gpt3,
  gpt_oss,
  llama2,
  llama4,
  minimax_m2,
  olmo3,
  qwen3_5,
  qwen3next,
)
from MaxText.models.deepseek import hf as deepseek_hf
from MaxText.models.gemma import hf as gemma_hf
from MaxText.models.gemma2 import hf as gemma2_hf
from MaxText.models.gemma3 import hf as gemma3_hf
from MaxText.models.gemma4 import hf as gemma4_hf
from MaxText.models.glm4_moe import hf as glm4_moe_hf
from MaxText.models.gpt3 import hf as gpt3_hf
from MaxText.models.gpt_oss import hf as gpt_oss_hf
from MaxText.models.llama2 import hf as llama2_hf
from MaxText.models.llama4 import hf as llama4_hf
from MaxText.models.minimax_m2 import hf as minimax_m2_hf
from MaxText.models.mistral import hf as mistral_hf
from MaxText.models.mixtral import hf as mixtral_hf
from MaxText.models.olmo3 import hf as olmo3_hf
from MaxText.models.qwen3 import hf as qwen3_hf
from MaxText.models.qwen3_5 import hf as qwen3_5_hf
from MaxText.models.qwen3next import hf as qwen3next_hf

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

# Llama 3, Mistral, Mixtral and Qwen3 differ from Llama 2 by config keys only (README, "Models"): their folders
# hold their Hugging Face mappings and presets, and reuse Llama 2's description.
REGISTRY: dict[str, Family] = {
  "default": llama2.FAMILY,
  "llama2": llama2.FAMILY,
  "mistral": llama2.FAMILY,
  "mixtral": llama2.FAMILY,
  "qwen3": llama2.FAMILY,
  "gemma": gemma.FAMILY,
  "gemma2": gemma2.FAMILY,
  "gemma3": gemma3.FAMILY,
  "deepseek": deepseek.FAMILY,
  "llama4": llama4.FAMILY,
  "gpt3": gpt3.FAMILY,
  "gpt_oss": gpt_oss.FAMILY,
  "qwen3next": qwen3next.FAMILY,
  "glm4_moe": glm4_moe.FAMILY,
  "olmo3": olmo3.FAMILY,
  "minimax_m2": minimax_m2.FAMILY,
  "qwen3_5": qwen3_5.FAMILY,
  "gemma4": gemma4.FAMILY,
}
# decoder_block -> its Hugging Face mapping ("default" has none).
HF: dict[str, Mapping] = {
  m.decoder_block: m
  for m in (
    llama2_hf.MAPPING,
    mistral_hf.MAPPING,
    mixtral_hf.MAPPING,
    qwen3_hf.MAPPING,
    gemma_hf.MAPPING,
    gemma2_hf.MAPPING,
    gemma3_hf.MAPPING,
    deepseek_hf.MAPPING,
    llama4_hf.MAPPING,
    gpt_oss_hf.MAPPING,
    qwen3next_hf.MAPPING,
    qwen3_5_hf.MAPPING,
    gpt3_hf.MAPPING,
    glm4_moe_hf.MAPPING,
    olmo3_hf.MAPPING,
    minimax_m2_hf.MAPPING,
    gemma4_hf.MAPPING,
  )
}


def family(config: ModelConfig) -> Family:
  """The family of config.decoder_block (checked against REGISTRY when the run plan is built)."""
  return REGISTRY[config.decoder_block]


def problem(config: Any) -> str | None:
  """Why the run's Config cannot build its family, or None: an unknown decoder_block, or a key the family needs
  or cannot take. The run plan's builder raises the answer as a ConfigError (planner.build)."""
  name = config.decoder_block
  if name not in REGISTRY:
    return f"Unknown decoder_block {name!r}; choose one of {', '.join(sorted(REGISTRY))}"
  if REGISTRY[name].learned_positions and config.trainable_position_size <= 0:
    return f"decoder_block={name} needs trainable_position_size > 0"
  if name in ("qwen3next", "qwen3_5"):  # the gated DeltaNet (layers/gated_deltanet.py)
    if config.full_attention_interval < 1 or config.linear_num_value_heads % max(config.linear_num_key_heads, 1):
      return (
        f"{name} needs full_attention_interval >= 1 and linear_num_value_heads a multiple of linear_num_key_heads; "
        f"got {config.full_attention_interval}, {config.linear_num_value_heads}, {config.linear_num_key_heads}"
      )
    if config.ici_context_parallelism * config.dcn_context_parallelism > 1:
      return f"{name}: the gated DeltaNet runs over whole sequences; set ici/dcn_context_parallelism=1"
  stages = config.ici_pipeline_parallelism * config.dcn_pipeline_parallelism
  if name == "gemma4" and config.hidden_size_per_layer_input and stages > 1:
    return (
      "gemma4 per-layer embeddings (hidden_size_per_layer_input > 0) do not run pipelined; "
      "set ici/dcn_pipeline_parallelism=1"
    )
  if name == "gemma4" and config.num_kv_shared_layers:  # the sharing layers' unit starts with a whole cycle
    first, period = config.num_decoder_layers - config.num_kv_shared_layers, config.full_attention_interval
    if first < period or first % period:
      return (
        f"gemma4 num_kv_shared_layers={config.num_kv_shared_layers} must leave a positive multiple of "
        f"full_attention_interval={period} layers before it (num_decoder_layers={config.num_decoder_layers})"
      )
  dense_layers = config.first_num_dense_layers or config.interleave_moe_layer_step > 1
  if name == "gemma4" and config.num_experts > 1 and dense_layers:
    return "gemma4's MoE block runs in every layer; set first_num_dense_layers=0 and interleave_moe_layer_step=1"
  rotary = config.head_dim * config.partial_rotary_factor
  if config.partial_rotary_factor != 1.0 and not (0 < rotary <= config.head_dim and rotary % 2 == 0):
    return (
      f"partial_rotary_factor={config.partial_rotary_factor} must rotate an even number of head_dim={config.head_dim} "
      "dims (0 < factor <= 1)"
    )
  if config.mtp_num_layers and REGISTRY[name].mtp_layer is None:
    with_mtp = ", ".join(sorted(block for block, family in REGISTRY.items() if family.mtp_layer is not None))
    return (
      f"mtp_num_layers={config.mtp_num_layers} is not available for decoder_block={name} "
      f"(multi-token prediction: {with_mtp}); set mtp_num_layers=0"
    )
  return None


def build(config: Any, rngs: nnx.Rngs, plan: Plan) -> Decoder:
  """The model for `config` (the run's Config: the model sees its ModelConfig, LoraConfig and whether the
  vision tower trains), run as `plan` says (planner.build(config, mesh)). Parameters carry logical axis names;
  they are placed by the caller."""
  model_config = ModelConfig.from_config(config)
  adapters = lora.LoraConfig.from_config(config)
  # Sharding is applied by the caller from the logical names (state.py), not eagerly per variable.
  with nnx.use_eager_sharding(False):
    return Decoder(
      model_config, family(model_config), rngs=rngs, plan=plan, lora=adapters,
      freeze_vision_encoder=config.freeze_vision_encoder,
    )  # fmt: skip
