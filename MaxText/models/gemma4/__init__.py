"""Gemma 4 (text): sliding-window layers with every full_attention_interval-th layer full (global) attention;
the full layers have their own head dim and kv-head count (global_head_dim, global_num_kv_heads), "proportional"
RoPE (rope_type) and, with attention_k_eq_v, no value projection (V is the key projection). Weighted q/k norms, a
weightless v norm, attention scale 1, RMSNorm x * w (not Gemma 1-3's 1 + w), pre+post norms around both
sublayers and a per-layer scalar on each layer's output."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.attention import Attention
from MaxText.layers.axes import HEAD_AXES, KV_HEAD_AXES
from MaxText.layers.decoder import Family, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.embeddings import apply_rope
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import RMSNorm, UnitRMSNorm

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan


def proportional_frequencies(head_dim: int, fraction: float, theta: float) -> jax.Array:
  """[head_dim / 2] inverse frequencies: the first int(fraction * head_dim // 2) are theta^(-2i / head_dim) (the
  exponent over the whole head), the rest 0 (those dim pairs are not rotated); transformers' "proportional"."""
  angles = int(fraction * head_dim // 2)
  rotated = 1.0 / (theta ** (jnp.arange(0, 2 * angles, 2, dtype=jnp.float32) / head_dim))
  return jnp.concatenate([rotated, jnp.zeros((head_dim // 2 - angles,), jnp.float32)])


class Gemma4Attention(Attention):
  """The shared attention with Gemma 4's q/k/v: weighted q/k norms (plain RMSNorm), a weightless norm on v, no
  query scaling; RoPE over the whole head on sliding layers, "proportional" on full ones (rope_type); `k_eq_v`:
  no value projection, v is the key projection before its norm."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, k_eq_v: bool = False, **kwargs: Any):
    super().__init__(config, rngs=rngs, plan=plan, **{**kwargs, "norm": RMSNorm, "use_qk_norm": True})
    if k_eq_v:
      self.value = nnx.data(None)
    args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
    self.value_norm = UnitRMSNorm(config.head_dim, weight_dtype=jnp.dtype(config.weight_dtype), **args)
    self.rotary_dim = config.head_dim  # partial_rotary_factor is the proportional RoPE's only
    self.query_scale = 1.0

  def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = nn.with_logical_constraint(checkpoint_name(self.query(x), "query_proj"), HEAD_AXES)
    k = nn.with_logical_constraint(checkpoint_name(self.key(x), "key_proj"), KV_HEAD_AXES)
    v = k if self.value is None else checkpoint_name(self.value(x), "value_proj")
    q, k, v = self.query_norm(q), self.key_norm(k), self.value_norm(v)
    return self.rope(q, positions), self.rope(k, positions), v

  def rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    if self.rope_type != "proportional":
      return super().rope(x, positions)
    fraction = self.config.rope.partial_rotary_factor
    return apply_rope(x, positions, proportional_frequencies(x.shape[-1], fraction, self.rope_max_timescale))


def global_config(config: ModelConfig) -> ModelConfig:
  """The config a full-attention layer is built from: its own head dim and kv-head count."""
  a = config.attention
  return dataclasses.replace(
    config, head_dim=a.global_head_dim or config.head_dim, num_kv_heads=a.global_num_kv_heads or config.num_kv_heads
  )


class Gemma4Layer(DecoderLayer):
  """A Gemma 4 decoder layer (`full`: global attention, else sliding-window), its output times `layer_scalar`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, full: bool):
    if full:
      attention = functools.partial(Gemma4Attention, k_eq_v=config.attention.attention_k_eq_v)
      super().__init__(global_config(config), rngs=rngs, plan=plan, norm=RMSNorm, sliding_window=0, attention=attention)
    else:
      local = dict(rope_max_timescale=config.rope.local_rope_max_timescale, rope_type="default")
      super().__init__(config, rngs=rngs, plan=plan, norm=RMSNorm, attention=Gemma4Attention, **local)
    self.layer_scalar = nnx.Param(jnp.ones((1,), jnp.dtype(config.weight_dtype)), out_sharding=("norm",))

  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None, cache: Any = None
  ) -> tuple[jax.Array, Any]:
    x, cache = super().__call__(x, positions, segment_ids, rng, cache)
    return x * self.layer_scalar[...].astype(x.dtype), cache


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  period = config.linear.full_attention_interval
  pattern = (functools.partial(Gemma4Layer, full=False),) * (period - 1) + (functools.partial(Gemma4Layer, full=True),)
  return alternating_stacks(config, pattern)


FAMILY = Family(stacks=stacks, norm=RMSNorm, scale_embeddings=True)
