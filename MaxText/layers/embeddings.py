"""Token embeddings and rotary position embeddings (RoPE, with Llama 3.1 and linear scaling)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config import Config


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` reuses it as the output projection (tied logits)."""

  def __init__(
    self,
    vocab_size: int,
    dim: int,
    *,
    dtype: jnp.dtype,
    weight_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    iota: bool = False,
  ):
    init = nnx.initializers.normal(stddev=1.0)
    self.embedding = nnx.Param(init(rngs.params(), (vocab_size, dim), weight_dtype), out_sharding=("vocab", "embed"))
    self.dtype, self.iota = dtype, iota

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> [B, T, D]; with `iota` a one-hot matmul instead of a gather (use_iota_embed)."""
    table = self.embedding[...]
    if self.iota:
      one_hot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
      return jnp.einsum("BTV,VD->BTD", one_hot, table).astype(self.dtype)
    return jnp.take(table, tokens, axis=0).astype(self.dtype)

  def attend(self, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x [B, T, D] -> logits [B, T, V]."""
    return jnp.einsum("BTD,VD->BTV", x.astype(dtype), self.embedding[...].astype(dtype))


def rope_frequencies(head_dim: int, min_timescale: float, max_timescale: float) -> jax.Array:
  """Inverse timescales [H/2]: min * (max/min)^(2i/H), the Llama/RoFormer schedule."""
  fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  return 1.0 / (min_timescale * (max_timescale / min_timescale) ** fraction)


def llama3_scaling(inv_freq: jax.Array, config: Config) -> jax.Array:
  """Llama 3.1: long wavelengths divided by rope_factor, short ones kept, a smooth blend between."""
  factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
  original = config.original_max_position_embeddings
  wavelen = 2 * math.pi / inv_freq
  smooth = (original / wavelen - low) / (high - low)
  blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
  medium = (wavelen >= original / high) & (wavelen <= original / low)
  return jnp.where(medium, blended, scaled)


def scaled_rope_frequencies(config: Config, head_dim: int, max_timescale: float, rope_type: str) -> jax.Array:
  """rope_frequencies with the rope_type scaling (default | llama3 | linear) applied."""
  inv_freq = rope_frequencies(head_dim, config.rope_min_timescale, max_timescale)
  if rope_type == "llama3":
    return llama3_scaling(inv_freq, config)
  if rope_type == "linear":
    return inv_freq / config.rope_factor
  return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate x [B, T, N, H] by positions [B, T]; halves layout (dims i and i + H/2 form a pair).

  The halves layout is Hugging Face's Llama convention, so converted checkpoints need no permutation.
  """
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
