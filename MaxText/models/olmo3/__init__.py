"""OLMo 3: post-norm layers (no norm before attention or the MLP; RMSNorm on each sublayer's output before its
residual add), q/k RMSNorm over the whole projected query and key vectors (all heads together, one scale per
projected dim), and three sliding-window layers (sliding_window_size, RoPE base local_rope_max_timescale,
unscaled) per full-attention layer (rope_max_timescale with rope_type scaling, YaRN in the released models)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.attention import HeadsNormAttention
from MaxText.layers.axes import ACTIVATION_AXES
from MaxText.layers.decoder import Family, Stack, alternating_stacks, dropout
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.moe import MoeBlock
from MaxText.layers.normalizations import RMSNorm

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

SLIDING_PER_FULL = 3  # layer i is full attention when (i + 1) % 4 == 0 (Olmo3Config's default layer_types)


class PostNormLayer(nnx.Module):
  """x [B, T, D] -> [B, T, D]: x + norm(attention(x)), then x + norm(mlp(x)); the DecoderLayer contract and
  parameter names (post_self_attention_norm, post_ffw_norm), without the pre-norms."""

  def __init__(
    self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, sliding_window: int | None = None,
    rope_max_timescale: float | None = None, rope_type: str | None = None,
  ):  # fmt: skip
    args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
    args["weight_dtype"] = jnp.dtype(config.weight_dtype)
    window = config.attention.sliding_window_size if sliding_window is None else sliding_window
    self.self_attention = HeadsNormAttention(
      config, rngs=rngs, plan=plan, sliding_window=window, rope_max_timescale=rope_max_timescale, rope_type=rope_type
    )
    self.post_self_attention_norm = RMSNorm(config.emb_dim, **args)
    self.mlp = (MoeBlock if config.moe.num_experts > 1 else MlpBlock)(config, rngs=rngs, plan=plan)
    self.post_ffw_norm = RMSNorm(config.emb_dim, **args)
    self.dropout_rate = plan.dropout_rate

  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None, cache: Any = None
  ) -> tuple[jax.Array, Any]:
    attn_rng, mlp_rng = (None, None) if rng is None else jax.random.split(rng)
    h, cache = self.self_attention(x, positions, segment_ids, None, cache)
    x = x + dropout(self.post_self_attention_norm(h), self.dropout_rate, attn_rng)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    x = x + dropout(self.post_ffw_norm(self.mlp(x)), self.dropout_rate, mlp_rng)
    return x, cache

  def init_cache(self, batch: int, length: int) -> Any:
    return self.self_attention.init_cache(batch, length)


def _sliding(config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan) -> PostNormLayer:
  local = config.rope.local_rope_max_timescale
  return PostNormLayer(config, rngs=rngs, plan=plan, rope_max_timescale=local, rope_type="default")


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  full = functools.partial(PostNormLayer, sliding_window=0)
  return alternating_stacks(config, (_sliding,) * SLIDING_PER_FULL + (full,))


FAMILY = Family(stacks=stacks)
