"""The decoder stack: embedding, N layers (scanned or unrolled, rematerialised), final norm, logits.

A family supplies only its layer class (models/<family>.py); everything around it is shared. Layers
are applied as pure functions of their parameters (nnx.split / nnx.merge) so that jax.lax.scan and
jax.checkpoint see plain pytrees.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config import Config
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.normalizations import RMSNorm

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")

_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
  "save_dot_except_mlp": jax.checkpoint_policies.save_only_these_names(
    "query_proj", "key_proj", "value_proj", "out_proj"
  ),
  "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj"),
}


def remat(fn: Callable, policy: str, prevent_cse: bool) -> Callable:
  """Wrap fn in jax.checkpoint with the named remat_policy ("none": store every activation)."""
  if policy == "none":
    return fn
  return jax.checkpoint(fn, policy=_POLICIES[policy], prevent_cse=prevent_cse)


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
  """Inverted dropout; identity when rng is None (evaluation, decoding) or rate is 0."""
  if rng is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _stacked_layers(layer_cls: type, config: Config, rngs: nnx.Rngs) -> nnx.Module:
  """One module whose parameters carry a leading `layers` axis of size num_decoder_layers."""

  @nnx.split_rngs(splits=config.num_decoder_layers)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return layer_cls(config, rngs=rngs)

  return create(rngs)


def _unrolled_layers(layer_cls: type, config: Config, rngs: nnx.Rngs) -> nnx.List:
  """num_decoder_layers separate modules, initialised exactly like the stacked ones.

  Slicing the stacked initialisation makes scan_layers=true and false the same model for a seed
  (and costs nothing under jit, where the stacked arrays are never materialised whole).
  """
  _, stacked = nnx.split(_stacked_layers(layer_cls, config, rngs))
  graphdef, template = nnx.split(nnx.eval_shape(lambda: layer_cls(config, rngs=nnx.Rngs(0))))
  treedef = jax.tree.structure(template)
  leaves = jax.tree.leaves(stacked)
  return nnx.List(
    [nnx.merge(graphdef, jax.tree.unflatten(treedef, [x[i] for x in leaves])) for i in range(config.num_decoder_layers)]
  )


class Decoder(nnx.Module):
  """tokens [B, T] -> logits [B, T, V]."""

  def __init__(self, config: Config, layer_cls: type, *, rngs: nnx.Rngs):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    self.config = config
    self.token_embedder = Embed(config.vocab_size, config.emb_dim, dtype=dt, weight_dtype=wdt, rngs=rngs)
    if config.scan_layers:
      self.layers = _stacked_layers(layer_cls, config, rngs)
    else:
      self.layers = _unrolled_layers(layer_cls, config, rngs)
    self.decoder_norm = RMSNorm(config.emb_dim, epsilon=config.normalization_layer_epsilon, dtype=dt, weight_dtype=wdt)
    self.logits_dense = nnx.data(None)
    if not config.logits_via_embedding:
      self.logits_dense = DenseGeneral(
        config.emb_dim, config.vocab_size, ("embed", "vocab"), dtype=dt, weight_dtype=wdt, rngs=rngs
      )

  def __call__(
    self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_rng: jax.Array | None = None
  ) -> jax.Array:
    c = self.config
    x = nn.with_logical_constraint(self.token_embedder(tokens), ACTIVATION_AXES)
    if not (c.enable_dropout and c.dropout_rate > 0):
      dropout_rng = None
    x = self._apply_layers(x, positions, segment_ids, dropout_rng)
    x = self.decoder_norm(x)
    logits_dtype = jnp.float32 if c.logits_dot_in_fp32 else jnp.dtype(c.dtype)
    if self.logits_dense is None:
      logits = self.token_embedder.attend(x, logits_dtype)
    else:
      logits = self.logits_dense(x.astype(logits_dtype)) if c.logits_dot_in_fp32 else self.logits_dense(x)
    return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))

  def _apply_layers(self, x, positions, segment_ids, dropout_rng):
    c = self.config
    if c.scan_layers:
      graphdef, params = nnx.split(self.layers)
    else:
      graphdef, _ = nnx.split(self.layers[0])
      params = [nnx.split(layer)[1] for layer in self.layers]

    def one_layer(carry, layer_params):
      h, index = carry
      rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
      h = nnx.merge(graphdef, layer_params)(h, positions, segment_ids, rng)
      return (nn.with_logical_constraint(h, ACTIVATION_AXES), index + 1), None

    # Under scan, CSE across iterations cannot happen, so prevent_cse (which costs fusion) is off.
    body = remat(one_layer, c.remat_policy, prevent_cse=not c.scan_layers)
    carry = (x, jnp.zeros((), jnp.int32))
    if c.scan_layers:
      carry, _ = jax.lax.scan(body, carry, params)
    else:
      for layer_params in params:
        carry, _ = body(carry, layer_params)
    return carry[0]
