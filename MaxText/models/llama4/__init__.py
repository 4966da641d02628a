"""Llama 4 (text): groups of nope_layer_interval layers whose last layer has no RoPE, no q/k norm, global
attention and temperature-tuned queries, the others RoPE with weightless q/k norms and chunked local
attention (chunk_attn_window_size); independently, the last layer of every group of
interleave_moe_layer_step is MoE (top-1 sigmoid router weighting the expert input, one shared expert),
the others dense. Layers cycle with the least common period of the two patterns, scanned as one block."""

from __future__ import annotations

import functools
import math

from MaxText.layers.attention import Attention
from MaxText.layers.decoder import Family, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.moe import MoeBlock
from MaxText.layers.normalizations import UnitRMSNorm
from MaxText.models.llama4 import vision


def is_nope_layer(config: ModelConfig, index: int) -> bool:
  """Layer `index` (0-based) has no RoPE: the last of each group of nope_layer_interval (HF no_rope_layers)."""
  interval = config.attention.nope_layer_interval
  return bool(interval) and (index + 1) % interval == 0


def is_moe_layer(config: ModelConfig, index: int) -> bool:
  """Layer `index` is MoE: the last of each group of interleave_moe_layer_step (HF moe_layers)."""
  return config.moe.num_experts > 1 and (index + 1) % config.moe.interleave_moe_layer_step == 0


def period(config: ModelConfig) -> int:
  """Layers per repeating unit: the least common multiple of the NoPE and MoE intervals."""
  return math.lcm(config.attention.nope_layer_interval or 1, config.moe.interleave_moe_layer_step)


def _layer(config: ModelConfig, *, rngs, plan, index: int) -> DecoderLayer:
  nope = is_nope_layer(config, index)
  attention = functools.partial(
    Attention, use_rope=not nope, use_qk_norm=config.attention.use_qk_norm and not nope, qk_norm=UnitRMSNorm,
    chunk_window=0 if nope else config.attention.chunk_attn_window_size,
  )  # fmt: skip
  mlp = MoeBlock if is_moe_layer(config, index) else MlpBlock
  return DecoderLayer(config, rngs=rngs, plan=plan, attention=attention, mlp=mlp)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  return alternating_stacks(config, tuple(functools.partial(_layer, index=i) for i in range(period(config))))


FAMILY = Family(stacks=stacks, vision=vision.Llama4VisionEncoder, splice=vision.splice)
