"""Llama 2 decoder layer: pre-norm attention and SwiGLU MLP with residuals (RMSNorm, RoPE, GQA)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config import Config
from MaxText.layers.attention import Attention
from MaxText.layers.decoder import ACTIVATION_AXES, dropout
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.normalizations import RMSNorm


class Llama2DecoderLayer(nnx.Module):
  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    norm = dict(epsilon=config.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
    norm["weight_dtype"] = jnp.dtype(config.weight_dtype)
    self.pre_self_attention_layer_norm = RMSNorm(config.emb_dim, **norm)
    self.self_attention = Attention(config, rngs=rngs)
    self.post_self_attention_layer_norm = RMSNorm(config.emb_dim, **norm)
    self.mlp = MlpBlock(config, rngs=rngs)
    self.dropout_rate = config.dropout_rate

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None) -> jax.Array:
    """x [B, T, D] -> [B, T, D]."""
    attn_rng, mlp_rng = (None, None) if rng is None else jax.random.split(rng)
    h = self.self_attention(self.pre_self_attention_layer_norm(x), positions, segment_ids)
    x = x + dropout(h, self.dropout_rate, attn_rng)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    h = self.mlp(self.post_self_attention_layer_norm(x))
    return x + dropout(h, self.dropout_rate, mlp_rng)
