"""Qwen3-Next: hybrid layers, the last of every group of full_attention_interval gated full attention
(output gate, partial RoPE, q/k norms), the others gated DeltaNet linear attention (layers/gated_deltanet.py);
every layer's feed-forward is the MoE with one gated shared expert (shared_expert_gate) when num_experts > 1.
All RMSNorms but the DeltaNet's output norm multiply by 1 + w (zero-centred weights). Layers cycle with period
full_attention_interval, scanned as one block."""

from __future__ import annotations

import functools

from MaxText.layers.decoder import Family, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.gated_deltanet import GatedAttention, GatedDeltaNet
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import gemma_rms_norm


def is_full_attention(config: ModelConfig, index: int) -> bool:
  """Layer `index` (0-based) is gated full attention (HF layer_types from full_attention_interval)."""
  return (index + 1) % config.linear.full_attention_interval == 0


def _layer(config: ModelConfig, *, rngs, plan, index: int) -> DecoderLayer:
  attention = GatedAttention if is_full_attention(config, index) else GatedDeltaNet
  return DecoderLayer(config, rngs=rngs, plan=plan, norm=gemma_rms_norm, attention=attention)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  pattern = tuple(functools.partial(_layer, index=i) for i in range(config.linear.full_attention_interval))
  return alternating_stacks(config, pattern)


FAMILY = Family(stacks=stacks, norm=gemma_rms_norm)
