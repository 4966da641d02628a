"""gpt-oss: layers alternating sliding-window (first) and full causal attention, every layer MoE.

Everything else is config keys (presets/gpt-oss-*.yml): attention_sink (a learned softmax logit
per head), attention_bias, YaRN RoPE (rope_type=yarn, rope_truncate=false), router_bias (a bias on the
router logits, softmax over the chosen experts' logits = renormalised top-k of the full softmax), mlp_bias
(every expert's biases) and the clamped SwiGLU (mlp_activations_limit, swiglu_alpha)."""

from __future__ import annotations

import functools

from MaxText.layers.decoder import Family, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.model_config import ModelConfig

PATTERN = (
  DecoderLayer,  # local: sliding_window_size (HF layer_types "sliding_attention")
  functools.partial(DecoderLayer, sliding_window=0),  # global ("full_attention")
)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  return alternating_stacks(config, PATTERN)


FAMILY = Family(stacks=stacks)
