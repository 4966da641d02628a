"""Token embeddings and rotary position embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` reuses it as the output projection (tied logits)."""

  def __init__(self, vocab_size: int, dim: int, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs):
    init = nnx.initializers.normal(stddev=1.0)
    self.embedding = nnx.Param(init(rngs.params(), (vocab_size, dim), weight_dtype), out_sharding=("vocab", "embed"))
    self.dtype = dtype

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> [B, T, D]."""
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

  def attend(self, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x [B, T, D] -> logits [B, T, V]."""
    return jnp.einsum("BTD,VD->BTV", x.astype(dtype), self.embedding[...].astype(dtype))


def rope_frequencies(head_dim: int, min_timescale: float, max_timescale: float) -> jax.Array:
  """Inverse timescales [H/2]: min * (max/min)^(2i/H), the Llama/RoFormer schedule."""
  fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  return 1.0 / (min_timescale * (max_timescale / min_timescale) ** fraction)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate x [B, T, N, H] by positions [B, T]; halves layout (dims i and i + H/2 form a pair).

  The halves layout is Hugging Face's Llama convention, so converted checkpoints need no permutation.
  """
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
