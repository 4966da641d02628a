"""Gemma 2: Gemma plus alternating local (sliding_window_size) and global layers, starting local; the
soft-caps, pre+post norms and query_pre_attn_scalar come from the config."""

from __future__ import annotations

import functools

from MaxText.layers.decoder import Family, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import gemma_rms_norm

PATTERN = (
  functools.partial(DecoderLayer, norm=gemma_rms_norm),  # local: sliding_window_size
  functools.partial(DecoderLayer, norm=gemma_rms_norm, sliding_window=0),  # global
)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  return alternating_stacks(config, PATTERN)


FAMILY = Family(stacks=stacks, norm=gemma_rms_norm, scale_embeddings=True)
