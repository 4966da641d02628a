"""Gemma: RMSNorm as x * (1 + w), embeddings scaled by sqrt(emb_dim); GeGLU and tied logits come from
the config (mlp_activations, logits_via_embedding)."""

from __future__ import annotations

import functools

from MaxText.config import Config
from MaxText.layers.decoder import Family, LayerBlock, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.normalizations import gemma_rms_norm


def stacks(config: Config) -> tuple[Stack, ...]:
  return (Stack("layers", functools.partial(DecoderLayer, norm=gemma_rms_norm), config.num_decoder_layers),)


FAMILY = Family(stacks=stacks, norm=gemma_rms_norm, scale_embeddings=True)


def alternating_stacks(config: Config, pattern: tuple[functools.partial, ...]) -> tuple[Stack, ...]:
  """Layers cycling through `pattern` (layer i is pattern[i % len]): whole cycles are scanned as one
  LayerBlock; a shorter remainder cycle, if any, forms a second stack."""
  period = len(pattern)
  cycles, rest = divmod(config.num_decoder_layers, period)
  out = []
  if cycles:
    out.append(Stack("layers", functools.partial(LayerBlock, makers=pattern), cycles, period))
  if rest:
    out.append(Stack("remainder_layers", functools.partial(LayerBlock, makers=pattern[:rest]), 1, rest))
  return tuple(out)
