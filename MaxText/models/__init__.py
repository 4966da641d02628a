"""Model families: a plain dict from decoder_block to the family's decoder-layer class."""

from __future__ import annotations

from flax import nnx

from MaxText.config import Config, ConfigError
from MaxText.layers.decoder import Decoder
from MaxText.models.llama2 import Llama2DecoderLayer

REGISTRY: dict[str, type[nnx.Module]] = {
  "default": Llama2DecoderLayer,
  "llama2": Llama2DecoderLayer,
}


def layer_class(config: Config) -> type[nnx.Module]:
  if config.decoder_block not in REGISTRY:
    raise ConfigError(f"Unknown decoder_block {config.decoder_block!r}; choose one of {', '.join(sorted(REGISTRY))}")
  return REGISTRY[config.decoder_block]


def build(config: Config, rngs: nnx.Rngs) -> Decoder:
  """The model for `config`. Parameters carry logical axis names; they are placed by the caller."""
  # Sharding is applied by the caller from the logical names (state.py), not eagerly per variable.
  with nnx.use_eager_sharding(False):
    return Decoder(config, layer_class(config), rngs=rngs)
