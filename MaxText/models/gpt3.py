"""GPT-3 (and GPT-2, its Hugging Face counterpart): LayerNorm with bias, learned absolute positions
(trainable_position_size), no RoPE, biases on every projection, a plain GELU MLP (mlp_activations)."""

from __future__ import annotations

import functools

from flax import nnx

from MaxText.config import Config
from MaxText.layers.attention import Attention
from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.normalizations import LayerNorm


def mlp_with_bias(config: Config, rngs: nnx.Rngs) -> MlpBlock:
  return MlpBlock(config, rngs=rngs, use_bias=True)


def stacks(config: Config) -> tuple[Stack, ...]:
  attention = functools.partial(Attention, use_bias=True, use_rope=False)
  layer = functools.partial(DecoderLayer, norm=LayerNorm, attention=attention, mlp=mlp_with_bias)
  return (Stack("layers", layer, config.num_decoder_layers),)


FAMILY = Family(stacks=stacks, norm=LayerNorm, learned_positions=True)
