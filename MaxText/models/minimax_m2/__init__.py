"""MiniMax M2: Llama 2's pre-norm layers (layers/decoder_layer.py) with every feed-forward a MoE routed by
sigmoid scores plus a selection bias, top-k renormalised, no shared expert (config keys only), and its own
attention: the q/k RMSNorms run over each token's whole projected query and key (all heads together, one
weight per channel), and RoPE rotates the first partial_rotary_factor of each head (rotary_dim)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.attention import Attention
from MaxText.layers.decoder import Family, Stack
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.model_config import ModelConfig


class HeadsRMSNorm(nnx.Module):
  """x [..., N, H] / rms over its last two axes together, times a scale [N * H] (transformers' q_norm/k_norm
  over the flat projection), in float32, returned in `dtype`."""

  def __init__(self, heads: int, head_dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((heads * head_dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-2], -1)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
    return (y * self.scale[...].astype(jnp.float32)).reshape(x.shape).astype(self.dtype)


class MiniMaxAttention(Attention):
  """The shared attention (partial RoPE from partial_rotary_factor) with q/k norms across heads when
  use_qk_norm."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan, **kw):
    super().__init__(config, rngs=rngs, plan=plan, **{**kw, "use_qk_norm": False})
    if config.attention.use_qk_norm:
      args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
      args["weight_dtype"] = jnp.dtype(config.weight_dtype)
      self.query_norm = HeadsRMSNorm(config.num_query_heads, config.head_dim, **args)
      self.key_norm = HeadsRMSNorm(config.num_kv_heads, config.head_dim, **args)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  layer = functools.partial(DecoderLayer, attention=MiniMaxAttention)
  return (Stack("layers", layer, config.num_decoder_layers),)


FAMILY = Family(stacks=stacks)
