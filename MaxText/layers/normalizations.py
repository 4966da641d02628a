"""Normalisation layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x / rms(x) * (scale_offset + scale), computed in float32 and returned in `dtype`.

  scale_offset=1 is Gemma's convention (stored weights are w, the multiplier is 1 + w, initialised at 0), so
  converted Gemma weights are stored unchanged.
  """

  def __init__(self, dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype, scale_offset: float = 0.0):
    init = jnp.zeros if scale_offset else jnp.ones
    self.scale = nnx.Param(init((dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype, self.scale_offset = epsilon, dtype, scale_offset

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (y * (self.scale_offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)


class HeadsRMSNorm(nnx.Module):
  """RMSNorm of x [..., N, H] over its last two axes together (a token's whole projected query or key, all heads),
  scale [N * H] as transformers' flat q_norm/k_norm stores it (olmo3, minimax_m2); float32, returned in `dtype`."""

  def __init__(self, heads: int, head_dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((heads * head_dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-2], -1)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (y * self.scale[...].astype(jnp.float32)).reshape(x.shape).astype(self.dtype)


def gemma_rms_norm(dim: int, **kwargs) -> RMSNorm:
  """Gemma's RMSNorm: multiplier 1 + w."""
  return RMSNorm(dim, scale_offset=1.0, **kwargs)


class UnitRMSNorm(nnx.Module):
  """x / rms(x) without a learned scale (llama4's q/k "L2" norm); RMSNorm's constructor, no parameters."""

  def __init__(self, dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    del dim, weight_dtype  # nothing to store
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)).astype(self.dtype)


class LayerNorm(nnx.Module):
  """(x - mean) / sqrt(var + epsilon) * scale + bias over the last axis, in float32 (gpt3)."""

  def __init__(self, dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), out_sharding=("norm",))
    self.bias = nnx.Param(jnp.zeros((dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)
