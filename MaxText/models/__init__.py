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


def build(config: Any, rngs: nnx.Rngs, plan: Plan) -> Decoder:
  """The model for `config` (the run's Config: the model sees its ModelConfig, LoraConfig and whether the
  vision tower trains), run as `plan` says
  (parallel.plan.build(config, mesh)). Parameters carry logical axis names; they are placed by the caller."""
  model_config = ModelConfig.from_config(config)
  adapters = lora.LoraConfig.from_config(config)
  # Sharding is applied by the caller from the logical names (state.py), not eagerly per variable.
  with nnx.use_eager_sharding(False):
    return Decoder(
      model_config, family(model_config), rngs=rngs, plan=plan, lora=adapters,
      freeze_vision_encoder=config.freeze_vision_encoder,
    )  # fmt: skip
