"""DeepSeek V2/V3: multi-head latent attention in every layer; the first first_num_dense_layers
layers have a dense MLP, the rest the MoE (routing options from the config), as two stacks. V3's
multi-token prediction (mtp_num_layers, layers/mtp.py) uses the MoE layer."""

from __future__ import annotations

import functools

from MaxText.layers.attention_mla import MLAttention
from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.model_config import ModelConfig

# The layer after the dense ones: MoE when num_experts > 1 (DecoderLayer's default), else a dense MLP.
MOE_LAYER = functools.partial(DecoderLayer, attention=MLAttention)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  dense, moe = config.moe.first_num_dense_layers, config.num_decoder_layers - config.moe.first_num_dense_layers
  out = []
  if dense:
    out.append(Stack("dense_layers", functools.partial(DecoderLayer, attention=MLAttention, mlp=MlpBlock), dense))
  if moe:
    out.append(Stack("moe_layers", MOE_LAYER, moe))
  return tuple(out)


# DeepSeek V3's multi-token-prediction modules each hold one MoE layer (model.layers.61 of the checkpoint).
FAMILY = Family(stacks=stacks, mtp_layer=MOE_LAYER)
