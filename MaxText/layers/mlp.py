"""Feed-forward blocks: gated (SwiGLU, GeGLU) or plain, chosen by mlp_activations."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.axes import MLP_AXES
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig

ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
  "relu": jax.nn.relu,
  "linear": lambda x: x,
}


class MlpBlock(nnx.Module):
  """y = wo(prod_i act_i(wi_i(x))): with ["silu", "linear"] this is SwiGLU. Biases on every projection
  with config.mlp_bias or `use_bias` (gpt3). Hidden width F: `mlp_dim`, by default config.mlp_dim (MoE
  shared experts pass their own)."""

  def __init__(
    self, config: ModelConfig, *, rngs: nnx.Rngs, use_bias: bool = False, mlp_dim: int | None = None, plan: Any = None
  ):
    # `plan` is unused: XLA partitions a dense MLP by itself. Taken so every feed-forward builder (this,
    # MoeBlock) has the signature DecoderLayer calls.
    unknown = [a for a in config.mlp_activations if a not in ACTIVATIONS]
    if unknown:
      raise ValueError(f"Unknown mlp_activations {unknown}; choose from {sorted(ACTIVATIONS)}")
    dense = dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype), rngs=rngs)
    dense["use_bias"] = use_bias or config.mlp_bias
    d, f = config.emb_dim, config.mlp_dim if mlp_dim is None else mlp_dim
    self.wi = nnx.List([DenseGeneral(d, f, ("embed", "mlp"), **dense) for _ in config.mlp_activations])
    self.wo = DenseGeneral(f, d, ("mlp", "embed"), **dense)
    self.activations = tuple(config.mlp_activations)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> [B, T, D]; hidden [B, T, F]."""
    hidden = None
    for name, wi in zip(self.activations, self.wi):
      h = ACTIVATIONS[name](checkpoint_name(wi(x), "mlpwi"))
      hidden = h if hidden is None else hidden * h
    hidden = nn.with_logical_constraint(hidden, MLP_AXES)
    return checkpoint_name(self.wo(hidden), "mlpwo")
