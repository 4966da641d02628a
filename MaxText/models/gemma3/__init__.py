"""Gemma 3: five local layers (sliding window, RoPE base local_rope_max_timescale, unscaled) then one
global layer (rope_max_timescale with rope_type scaling); q/k norms and pre+post norms from the config."""

from __future__ import annotations

import functools

from MaxText.layers.decoder import Family, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import gemma_rms_norm

LOCAL_PER_GLOBAL = 5


def _local(config: ModelConfig, *, rngs, plan):
  return DecoderLayer(
    config,
    rngs=rngs,
    plan=plan,
    norm=gemma_rms_norm,
    rope_max_timescale=config.rope.local_rope_max_timescale,
    rope_type="default",
  )


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  glob = functools.partial(DecoderLayer, norm=gemma_rms_norm, sliding_window=0)
  return alternating_stacks(config, (_local,) * LOCAL_PER_GLOBAL + (glob,))


FAMILY = Family(stacks=stacks, norm=gemma_rms_norm, scale_embeddings=True)
