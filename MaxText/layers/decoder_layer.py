"""The pre-norm transformer layer most families share: norm -> attention -> (norm) -> residual, then
norm -> MLP or MoE -> (norm) -> residual. Families vary it through the config (q/k norms, post norms,
experts) and through constructor arguments (norm convention, local window, RoPE base)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.attention import Attention
from MaxText.layers.axes import ACTIVATION_AXES
from MaxText.layers.mlp import MlpBlock
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.moe import MoeBlock
from MaxText.layers.normalizations import RMSNorm

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
  """Inverted dropout; identity when rng is None (evaluation, decoding) or rate is 0."""
  if rng is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class DecoderLayer(nnx.Module):
  """x [B, T, D] -> [B, T, D]. `norm` builds every norm of the layer (RMSNorm or Gemma's 1 + w);
  `attention` and `mlp` are builders `(config, *, rngs, plan)` of the attention (Attention, MLAttention)
  and the feed-forward block; mlp=None: a MoeBlock when config.moe.num_experts > 1, else an MlpBlock. `plan`:
  the run plan (parallel/plan.py), passed on to both."""

  def __init__(
    self,
    config: ModelConfig,
    *,
    rngs: nnx.Rngs,
    plan: Plan,
    norm: Callable[..., nnx.Module] = RMSNorm,
    sliding_window: int | None = None,
    rope_max_timescale: float | None = None,
    rope_type: str | None = None,
    attention: Callable[..., nnx.Module] = Attention,
    mlp: Callable[..., nnx.Module] | None = None,
  ):
    args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
    args["weight_dtype"] = jnp.dtype(config.weight_dtype)
    d = config.emb_dim
    window = config.attention.sliding_window_size if sliding_window is None else sliding_window
    self.pre_self_attention_layer_norm = norm(d, **args)
    self.self_attention = attention(
      config,
      rngs=rngs,
      plan=plan,
      sliding_window=window,
      rope_max_timescale=rope_max_timescale,
      rope_type=rope_type,
      norm=norm,
    )
    self.post_self_attention_norm = norm(d, **args) if config.norms.use_post_attn_norm else nnx.data(None)
    self.post_self_attention_layer_norm = norm(d, **args)  # the pre-MLP norm (MaxText's name)
    if mlp is None:
      mlp = MoeBlock if config.moe.num_experts > 1 else MlpBlock
    self.mlp = mlp(config, rngs=rngs, plan=plan)
    self.post_ffw_norm = norm(d, **args) if config.norms.use_post_ffw_norm else nnx.data(None)
    self.dropout_rate = plan.dropout_rate

  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None, cache: Any = None
  ) -> tuple[jax.Array, Any]:
    """x [B, T, D], positions/segment_ids [B, T] -> (x [B, T, D], cache). `rng`: dropout (None: off);
    `cache`: the attention's decode cache, returned updated (None in training, and then returned None)."""
    return self.around(x, rng, lambda h: self.self_attention(h, positions, segment_ids, None, cache))

  def around(self, x: jax.Array, rng: jax.Array | None, attention: Callable[..., tuple]) -> tuple:
    """The layer around `attention` (the normed x -> (out, *extras): the cache, and Gemma 4's shared keys and
    values) -> (x, *extras)."""
    attn_rng, mlp_rng = (None, None) if rng is None else jax.random.split(rng)
    h, *extras = attention(self.pre_self_attention_layer_norm(x))
    if self.post_self_attention_norm is not None:
      h = self.post_self_attention_norm(h)
    x = nn.with_logical_constraint(x + dropout(h, self.dropout_rate, attn_rng), ACTIVATION_AXES)
    return x + dropout(self.feed_forward(x), self.dropout_rate, mlp_rng), *extras

  def feed_forward(self, x: jax.Array) -> jax.Array:
    """The feed-forward sublayer's output (before the residual): norm -> MLP or MoE -> (norm)."""
    h = self.mlp(self.post_self_attention_layer_norm(x))
    return h if self.post_ffw_norm is None else self.post_ffw_norm(h)

  def init_cache(self, batch: int, length: int) -> Any:
    return self.self_attention.init_cache(batch, length)
