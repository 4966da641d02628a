"""Gemma: RMSNorm as x * (1 + w), embeddings scaled by sqrt(emb_dim); GeGLU and tied logits come from
the config (mlp_activations, logits_via_embedding)."""

from __future__ import annotations

import functools

from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import gemma_rms_norm


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  return (Stack("layers", functools.partial(DecoderLayer, norm=gemma_rms_norm), config.num_decoder_layers),)


FAMILY = Family(stacks=stacks, norm=gemma_rms_norm, scale_embeddings=True)
