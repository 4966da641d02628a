"""MiniMax M2: Llama 2's pre-norm layers (layers/decoder_layer.py) with every feed-forward a MoE routed by
sigmoid scores plus a selection bias, top-k renormalised, no shared expert (config keys only), and its own
attention: the q/k RMSNorms run over each token's whole projected query and key (all heads together, one
weight per channel), and RoPE rotates the first partial_rotary_factor of each head (rotary_dim)."""

from __future__ import annotations

import functools

from MaxText.layers.attention import HeadsNormAttention
from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.model_config import ModelConfig


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  layer = functools.partial(DecoderLayer, attention=HeadsNormAttention)
  return (Stack("layers", layer, config.num_decoder_layers),)


FAMILY = Family(stacks=stacks)
