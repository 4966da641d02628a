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
from MaxText.parallel.remat import remat

# model_config.Activation lists the same names (model_config_test checks): the model config refuses others.
ACTIVATIONS = {
  "silu": jax.nn.silu,
  "gelu": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
  "relu": jax.nn.relu,
  "linear": lambda x: x,
}


class MlpBlock(nnx.Module):
  """y = wo(prod_i act_i(wi_i(x))): with ["silu", "linear"] this is SwiGLU. Biases on every projection
  with config.mlp.mlp_bias or `use_bias` (gpt3). Hidden width F: `mlp_dim`, by default config.mlp_dim (MoE
  shared experts pass their own)."""

  def __init__(
    self, config: ModelConfig, *, rngs: nnx.Rngs, use_bias: bool = False, mlp_dim: int | None = None, plan: Any = None
  ):
    # XLA partitions a dense MLP by itself; the plan says only in how many sequence parts it runs (mlp_pieces).
    dense = dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype), rngs=rngs)
    dense["use_bias"] = use_bias or config.mlp.mlp_bias
    d, f = config.emb_dim, config.mlp_dim if mlp_dim is None else mlp_dim
    self.wi = nnx.List([DenseGeneral(d, f, ("embed", "mlp"), **dense) for _ in config.mlp.mlp_activations])
    self.wo = DenseGeneral(f, d, ("mlp", "embed"), **dense)
    self.activations = tuple(config.mlp.mlp_activations)
    self.pieces = 1 if plan is None else plan.mlp_pieces
    self.remat_policy = "full" if plan is None else plan.remat_policy

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, T, D] -> [B, T, D]; hidden [B, T, F]. With the plan's mlp_pieces > 1 the sequence goes through
    in that many parts under lax.map, each part rematerialised on its own (planner.Pieces): the
    backward pass then holds one part's hidden activations at a time, and every token's result is the same."""
    b, t, d = x.shape
    n = self.pieces
    if n == 1 or t % n:  # other lengths (eval or scoring at another length) run whole
      return self._apply(x)
    graphdef, state = nnx.split(self)
    part = remat(lambda state, x: nnx.merge(graphdef, state)._apply(x), self.remat_policy, prevent_cse=False)
    out = jax.lax.map(lambda x: part(state, x), x.reshape(b, n, t // n, d).swapaxes(0, 1))  # [n, B, T/n, D]
    return out.swapaxes(0, 1).reshape(b, t, d)

  def _apply(self, x: jax.Array) -> jax.Array:
    hidden = None
    for name, wi in zip(self.activations, self.wi):
      h = ACTIVATIONS[name](checkpoint_name(wi(x), "mlpwi"))
      hidden = h if hidden is None else hidden * h
    hidden = nn.with_logical_constraint(hidden, MLP_AXES)
    return checkpoint_name(self.wo(hidden), "mlpwo")
