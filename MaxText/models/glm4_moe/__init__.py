"""GLM-4.5 (glm4_moe): Llama-style GQA attention with q/k/v biases (none on o), optional per-head q/k RMSNorms
(use_qk_norm) and RoPE on the first partial_rotary_factor of each head; the first first_num_dense_layers layers
have a dense MLP, the rest DeepSeek V3's MoE (sigmoid router with a selection bias, routed_scaling_factor, shared
experts), as two stacks. Its multi-token-prediction layers (mtp_num_layers, layers/mtp.py) use the MoE layer."""

from __future__ import annotations

import functools

from MaxText.layers.attention import Attention
from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.model_config import ModelConfig

ATTENTION = functools.partial(Attention, out_bias=False)
# The layer after the dense ones: MoE when num_experts > 1 (DecoderLayer's default), else a dense MLP.
MOE_LAYER = functools.partial(DecoderLayer, attention=ATTENTION)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  dense, moe = config.moe.first_num_dense_layers, config.num_decoder_layers - config.moe.first_num_dense_layers
  out = []
  if dense:
    out.append(Stack("dense_layers", functools.partial(DecoderLayer, attention=ATTENTION, mlp=MlpBlock), dense))
  if moe:
    out.append(Stack("moe_layers", MOE_LAYER, moe))
  return tuple(out)


FAMILY = Family(stacks=stacks, mtp_layer=MOE_LAYER)
