"""DeepSeek V3 multi-token prediction (MTP): D extra modules that predict tokens 2, 3, ... D+1 ahead.

Module k (k = 1..D) at position i combines the previous depth's hidden state h^{k-1}_i (h^0: the main
model's last hidden state, before its final norm) with the embedding of token t_{i+k}:

    h'_i = eh_proj([enorm(Emb(t_{i+k})), hnorm(h^{k-1}_i)])     # [B, T, 2D] -> [B, T, D]
    h^k_i = layer(h'_i)                                           # one transformer layer of the family
    logits = head(shared_head_norm(h^k_i))                        # predicts t_{i+k+1}

The embedding and the output head are the main model's (shared); the norms, eh_proj and the layer are the
module's own. The concatenation order (embedding first) is that of DeepSeek's checkpoints (eh_proj's input
columns) and of the inference engines that load them; the paper writes the hidden state first.
The modules serve training only: decoding builds the model without them (inference/engine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import RMSNorm


class MtpModule(nnx.Module):
  """One MTP depth. `layer` builds the transformer layer `(config, *, rngs)` (the family's last kind);
  the decoder applies it (scan/remat as its own layers), so this module only mixes and normalises."""

  def __init__(self, config: ModelConfig, layer: Callable[..., nnx.Module], *, rngs: nnx.Rngs):
    d, dt, wdt = config.emb_dim, jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    norm = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=dt, weight_dtype=wdt)
    self.enorm, self.hnorm, self.shared_head_norm = RMSNorm(d, **norm), RMSNorm(d, **norm), RMSNorm(d, **norm)
    # [2D, D] like an MLP's output projection: the contracted (concatenated) dim on `mlp`.
    self.eh_proj = DenseGeneral(2 * d, d, ("mlp", "embed"), dtype=dt, weight_dtype=wdt, rngs=rngs)
    self.layer = layer(config, rngs=rngs)

  def mix(self, hidden: jax.Array, embedded: jax.Array) -> jax.Array:
    """hidden h^{k-1} [B, T, D], embedded Emb(t_{i+k}) [B, T, D] -> the layer's input [B, T, D]."""
    both = jnp.concatenate([self.enorm(embedded), self.hnorm(hidden).astype(embedded.dtype)], axis=-1)
    return self.eh_proj(both)


def shift_left(x: jax.Array, k: int, fill: int = 0) -> jax.Array:
  """x [B, T] -> y [B, T] with y[:, i] = x[:, i + k], and `fill` in the last k positions."""
  return jnp.pad(x[:, k:], ((0, 0), (0, k)), constant_values=fill)


class ShiftedTargets(NamedTuple):
  targets: jax.Array  # int32 [B, T]: what depth k predicts at position i, t_{i+k+1} = targets[i + k]
  mask: jax.Array  # float32 [B, T]: 1 where that target exists in position i's own segment


def shifted_targets(targets: jax.Array, targets_segmentation: jax.Array, k: int) -> ShiftedTargets:
  """Depth k's targets and loss mask from a batch's targets and targets_segmentation [B, T].

  A position gets no MTP loss when its shifted target lies past the end of the row (the last k positions),
  in padding (segment 0) or in another packed segment: that token is not the continuation of this one."""
  segments = shift_left(targets_segmentation, k)
  mask = (segments != 0) & (segments == targets_segmentation)
  return ShiftedTargets(shift_left(targets, k), mask.astype(jnp.float32))
