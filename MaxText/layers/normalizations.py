"""Normalisation layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, computed in float32 and returned in `dtype`."""

  def __init__(self, dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)
