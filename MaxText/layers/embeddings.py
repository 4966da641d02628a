"""Token embeddings and rotary position embeddings (RoPE, with Llama 3.1, linear and YaRN scaling)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.model_config import ModelConfig


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` reuses it as the output projection (tied logits).

  Initialised N(0, 1/D) (fan-in variance scaling over D, as MaxText): with tied logits a unit-RMS final
  activation then gives logits of unit variance, so a fresh model starts near loss ln(V). Families that
  scale embeddings by sqrt(D) (gemma) then feed the first layer unit-variance activations.
  """

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
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1, out_axis=0)
    self.embedding = nnx.Param(init(rngs.params(), (vocab_size, dim), weight_dtype), out_sharding=("vocab", "embed"))
    self.dtype, self.iota = dtype, iota

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int -> [B, T, D]; with `iota` a one-hot matmul instead of a gather (use_iota_embed)."""
    # Cast before the gather: its gradient (scattered back into the fsdp-sharded table) then moves in
    # the compute dtype, not in float32 (a [B, T, D] f32 all-to-all per step at scale).
    table = self.embedding[...].astype(self.dtype)
    if self.iota:
      one_hot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
      return jnp.einsum("BTV,VD->BTD", one_hot, table)
    return jnp.take(table, tokens, axis=0)

  def attend(self, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x [B, T, D] -> logits [B, T, V]."""
    return jnp.einsum("BTD,VD->BTV", x.astype(dtype), self.embedding[...].astype(dtype))


def rope_timescales(head_dim: int, min_timescale: float, max_timescale: float) -> jax.Array:
  """Timescales [H/2]: min * (max/min)^(2i/H), the Llama/RoFormer schedule."""
  fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  return min_timescale * (max_timescale / min_timescale) ** fraction


def rope_frequencies(head_dim: int, min_timescale: float, max_timescale: float) -> jax.Array:
  """Inverse timescales [H/2] (rope_timescales)."""
  return 1.0 / rope_timescales(head_dim, min_timescale, max_timescale)


def llama3_scaling(inv_freq: jax.Array, config: ModelConfig) -> jax.Array:
  """Llama 3.1: long wavelengths divided by rope_factor, short ones kept, a smooth blend between."""
  factor, low, high = config.rope.rope_factor, config.rope.rope_low_freq_factor, config.rope.rope_high_freq_factor
  original = config.rope.original_max_position_embeddings
  wavelen = 2 * math.pi / inv_freq
  smooth = (original / wavelen - low) / (high - low)
  blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
  medium = (wavelen >= original / high) & (wavelen <= original / low)
  return jnp.where(medium, blended, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(head_dim: int, config: ModelConfig, max_timescale: float) -> jax.Array:
  """YaRN (as transformers computes it): dims rotating more than rope_beta_fast times over
  original_max_position_embeddings keep their frequency, those rotating fewer than rope_beta_slow
  times are divided by rope_factor, a linear ramp over the dims between."""
  factor, original, base = config.rope.rope_factor, config.rope.original_max_position_embeddings, max_timescale

  def correction_dim(rotations: float) -> float:  # the dim that rotates `rotations` times over `original`
    return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(config.rope.rope_beta_fast), correction_dim(config.rope.rope_beta_slow)
  if config.rope.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # avoid a zero-width ramp
  timescale = rope_timescales(head_dim, config.rope.rope_min_timescale, base)
  keep = 1 - jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  return (1.0 / (factor * timescale)) * (1 - keep) + (1.0 / timescale) * keep


def scaled_rope_frequencies(config: ModelConfig, head_dim: int, max_timescale: float, rope_type: str) -> jax.Array:
  """rope_frequencies with the rope_type scaling (default | llama3 | linear | yarn) applied."""
  if rope_type == "yarn":
    return yarn_scaling(head_dim, config, max_timescale)
  inv_freq = rope_frequencies(head_dim, config.rope.rope_min_timescale, max_timescale)
  if rope_type == "llama3":
    return llama3_scaling(inv_freq, config)
  if rope_type == "linear":
    return inv_freq / config.rope.rope_factor
  return inv_freq


def rope_attention_factor(config: ModelConfig, rope_type: str) -> float:
  """Multiplier of cos/sin (so of the rotated dims): 1 except for yarn, where it is rope_attention_factor
  or, when that is 0, mscale(rope_factor, rope_mscale) / mscale(rope_factor, rope_mscale_all_dim) when
  both are set, else mscale(rope_factor)."""
  if rope_type != "yarn":
    return 1.0
  if config.rope.rope_attention_factor:
    return config.rope.rope_attention_factor
  factor, mscale, mscale_all_dim = config.rope.rope_factor, config.rope.rope_mscale, config.rope.rope_mscale_all_dim
  if mscale and mscale_all_dim:
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  return yarn_mscale(factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
  """Rotate x [B, T, N, H] by positions [B, T], times `scale` (rope_attention_factor); halves layout
  (dims i and i + H/2 form a pair).

  The halves layout is Hugging Face's Llama convention, so converted checkpoints need no permutation.
  Partial RoPE: when inv_freq covers fewer than H/2 pairs, only the first 2 * len(inv_freq) dims rotate.
  """
  rotary = 2 * inv_freq.shape[-1]
  if rotary < x.shape[-1]:
    return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq, scale), x[..., rotary:]], axis=-1)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  if scale != 1.0:
    sin, cos = sin * scale, cos * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
