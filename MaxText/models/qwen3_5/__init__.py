"""Qwen3.5-MoE and dense Qwen3.5: Qwen3-Next's hybrid stack (every full_attention_interval-th layer gated full
attention, the others gated DeltaNet linear attention; MoE with one sigmoid-gated shared expert in every layer;
norms 1 + w but the DeltaNet's gated output norm) with the DeltaNet's projections separate (layers/gated_deltanet.py's
SplitGatedDeltaNet: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) instead of Qwen3-Next's fused ones. Dense
Qwen3.5 is the same stack with num_experts 1: DecoderLayer then builds a gated MLP in every layer."""

from __future__ import annotations

import functools

from MaxText.layers.decoder import Family, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.gated_deltanet import GatedAttention, SplitGatedDeltaNet
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import gemma_rms_norm
from MaxText.models.qwen3next import is_full_attention


def _layer(config: ModelConfig, *, rngs, plan, index: int) -> DecoderLayer:
  attention = GatedAttention if is_full_attention(config, index) else SplitGatedDeltaNet
  return DecoderLayer(config, rngs=rngs, plan=plan, norm=gemma_rms_norm, attention=attention)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  pattern = tuple(functools.partial(_layer, index=i) for i in range(config.linear.full_attention_interval))
  return alternating_stacks(config, pattern)


FAMILY = Family(stacks=stacks, norm=gemma_rms_norm)
