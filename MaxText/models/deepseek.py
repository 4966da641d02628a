"""DeepSeek V2/V3: multi-head latent attention in every layer; the first first_num_dense_layers
layers have a dense MLP, the rest the MoE (routing options from the config), as two stacks."""

from __future__ import annotations

import functools

from MaxText.config import Config
from MaxText.layers.attention_mla import MLAttention
from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.mlp import MlpBlock


def stacks(config: Config) -> tuple[Stack, ...]:
  dense, moe = config.first_num_dense_layers, config.num_decoder_layers - config.first_num_dense_layers
  out = []
  if dense:
    out.append(Stack("dense_layers", functools.partial(DecoderLayer, attention=MLAttention, mlp=MlpBlock), dense))
  if moe:
    out.append(Stack("moe_layers", functools.partial(DecoderLayer, attention=MLAttention), moe))
  return tuple(out)


FAMILY = Family(stacks=stacks)
