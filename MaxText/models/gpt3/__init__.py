"""GPT-3 (and GPT-2, its Hugging Face counterpart): LayerNorm with bias, learned absolute positions
(trainable_position_size), no RoPE, biases on every projection, a plain GELU MLP (mlp_activations)."""

from __future__ import annotations

import functools

from MaxText.layers.attention import Attention
from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import LayerNorm


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  attention = functools.partial(Attention, use_bias=True, use_rope=False)
  mlp = functools.partial(MlpBlock, use_bias=True)
  layer = functools.partial(DecoderLayer, norm=LayerNorm, attention=attention, mlp=mlp)
  return (Stack("layers", layer, config.num_decoder_layers),)


FAMILY = Family(stacks=stacks, norm=LayerNorm, learned_positions=True)
