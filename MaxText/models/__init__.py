"""Model families: a plain dict from decoder_block to the family's description (layers/decoder.Family)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flax import nnx

from MaxText.layers import lora
from MaxText.layers.decoder import Decoder, Family
from MaxText.layers.model_config import ModelConfig
from MaxText.models import deepseek, gemma, gemma2, gemma3, gpt3, gpt_oss, llama2, llama4, qwen3next

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

# Llama 3, Mistral, Mixtral and Qwen3 differ from Llama 2 by config keys only (README, "Models").
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
  if name == "qwen3next":  # the gated DeltaNet (layers/gated_deltanet.py)
    if config.full_attention_interval < 1 or config.linear_num_value_heads % max(config.linear_num_key_heads, 1):
      return (
        "qwen3next needs full_attention_interval >= 1 and linear_num_value_heads a multiple of linear_num_key_heads; "
        f"got {config.full_attention_interval}, {config.linear_num_value_heads}, {config.linear_num_key_heads}"
      )
    if config.ici_context_parallelism * config.dcn_context_parallelism > 1:
      return "qwen3next: the gated DeltaNet runs over whole sequences; set ici/dcn_context_parallelism=1"
  if config.mtp_num_layers and REGISTRY[name].mtp_layer is None:
    return (
      f"mtp_num_layers={config.mtp_num_layers} is not available for decoder_block={name} "
      "(multi-token prediction: deepseek and the llama2 family); set mtp_num_layers=0"
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
