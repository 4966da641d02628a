"""The decoder stack: embedding, layers (scanned or unrolled, rematerialised), final norm, logits.

A family (models/<family>.py) describes itself as data, a `Family`: which layers in which stacks,
its norm convention, whether embeddings are scaled. Everything around the layers is shared. Layers
are applied as pure functions of their parameters (nnx.split / nnx.merge) so that jax.lax.scan and
jax.checkpoint see plain pytrees. Families that alternate layer kinds (local/global attention) scan
over a repeating `LayerBlock`; families whose first layers differ (dense, then MoE) use two stacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config import Config
from MaxText.layers.attention import soft_cap
from MaxText.layers.decoder_layer import ACTIVATION_AXES, DecoderLayer, dropout
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.normalizations import RMSNorm

__all__ = ["ACTIVATION_AXES", "Decoder", "DecoderOutput", "Family", "LayerBlock", "Stack", "dropout", "remat"]

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


@dataclasses.dataclass(frozen=True)
class Stack:
  """`repeats` copies of the unit `make(config, rngs=...)`, each unit holding `layers_per_unit` layers."""

  name: str  # the Decoder attribute holding the stack (its parameter path)
  make: Callable[..., nnx.Module]
  repeats: int
  layers_per_unit: int = 1


def single_stack(config: Config) -> tuple[Stack, ...]:
  return (Stack("layers", DecoderLayer, config.num_decoder_layers),)


@dataclasses.dataclass(frozen=True)
class Family:
  """What a model family changes around its layers."""

  stacks: Callable[[Config], tuple[Stack, ...]] = single_stack  # the layers, in order
  norm: Callable[..., nnx.Module] = RMSNorm  # the final norm's convention
  scale_embeddings: bool = False  # multiply token embeddings by sqrt(emb_dim) (gemma)


class LayerBlock(nnx.Module):
  """A repeating unit of differently configured layers, applied in order (e.g. local, global)."""

  def __init__(self, config: Config, makers: tuple[Callable[..., nnx.Module], ...], *, rngs: nnx.Rngs):
    self.sublayers = nnx.List([make(config, rngs=rngs) for make in makers])

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None) -> jax.Array:
    for i, layer in enumerate(self.sublayers):
      x = layer(x, positions, segment_ids, None if rng is None else jax.random.fold_in(rng, i))
    return x


def _stacked_layers(stack: Stack, config: Config, rngs: nnx.Rngs) -> nnx.Module:
  """One module whose parameters carry a leading `layers` axis of size stack.repeats."""

  @nnx.split_rngs(splits=stack.repeats)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return stack.make(config, rngs=rngs)

  return create(rngs)


def _unrolled_layers(stack: Stack, config: Config, rngs: nnx.Rngs) -> nnx.List:
  """stack.repeats separate modules, initialised exactly like the stacked ones.

  Slicing the stacked initialisation makes scan_layers=true and false the same model for a seed
  (and costs nothing under jit, where the stacked arrays are never materialised whole).
  """
  _, stacked = nnx.split(_stacked_layers(stack, config, rngs))
  graphdef, template = nnx.split(nnx.eval_shape(lambda: stack.make(config, rngs=nnx.Rngs(0))))
  treedef = jax.tree.structure(template)
  leaves = jax.tree.leaves(stacked)
  return nnx.List(
    [nnx.merge(graphdef, jax.tree.unflatten(treedef, [x[i] for x in leaves])) for i in range(stack.repeats)]
  )


def _intermediates_sum(module: nnx.Module) -> jax.Array:
  """Sum of the values a layer recorded as nnx.Intermediate during its call (MoE auxiliary losses)."""
  values = jax.tree.leaves(nnx.state(module, nnx.Intermediate))
  return sum((jnp.sum(v).astype(jnp.float32) for v in values), jnp.zeros((), jnp.float32))


class DecoderOutput(NamedTuple):
  logits: jax.Array  # [B, T, V]
  aux_loss: jax.Array  # float32 scalar: the layers' auxiliary losses (MoE load balance), averaged over layers


class Decoder(nnx.Module):
  """tokens [B, T] -> logits [B, T, V]."""

  def __init__(self, config: Config, family: Family, *, rngs: nnx.Rngs):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    self.config, self.family = config, family
    self.token_embedder = Embed(config.vocab_size, config.emb_dim, dtype=dt, weight_dtype=wdt, rngs=rngs)
    self.stack_specs = family.stacks(config)
    build = _stacked_layers if config.scan_layers else _unrolled_layers
    for stack in self.stack_specs:
      setattr(self, stack.name, build(stack, config, rngs))
    self.decoder_norm = family.norm(
      config.emb_dim, epsilon=config.normalization_layer_epsilon, dtype=dt, weight_dtype=wdt
    )
    self.logits_dense = nnx.data(None)
    if not config.logits_via_embedding:
      self.logits_dense = DenseGeneral(
        config.emb_dim, config.vocab_size, ("embed", "vocab"), dtype=dt, weight_dtype=wdt, rngs=rngs
      )

  def __call__(
    self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_rng: jax.Array | None = None
  ) -> jax.Array:
    return self.forward(tokens, positions, segment_ids, dropout_rng).logits

  def forward(
    self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_rng: jax.Array | None = None
  ) -> DecoderOutput:
    """tokens/positions/segment_ids [B, T] -> logits [B, T, V] and the auxiliary loss."""
    c = self.config
    x = self.token_embedder(tokens)
    if self.family.scale_embeddings:
      x = x * jnp.asarray(c.emb_dim**0.5, x.dtype)
    x = nn.with_logical_constraint(x, ACTIVATION_AXES)
    if not (c.enable_dropout and c.dropout_rate > 0):
      dropout_rng = None
    aux, first = jnp.zeros((), jnp.float32), 0
    for stack in self.stack_specs:
      x, stack_aux = self._apply_stack(stack, x, positions, segment_ids, dropout_rng, first)
      aux, first = aux + stack_aux, first + stack.repeats
    x = self.decoder_norm(x)
    logits_dtype = jnp.float32 if c.logits_dot_in_fp32 else jnp.dtype(c.dtype)
    if self.logits_dense is None:
      logits = self.token_embedder.attend(x, logits_dtype)
    else:
      logits = self.logits_dense(x.astype(logits_dtype)) if c.logits_dot_in_fp32 else self.logits_dense(x)
    logits = soft_cap(logits, c.final_logits_soft_cap)
    logits = nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))
    return DecoderOutput(logits, aux / c.num_decoder_layers)

  def _apply_stack(self, stack, x, positions, segment_ids, dropout_rng, first_index):
    c = self.config
    layers = getattr(self, stack.name)
    if c.scan_layers:
      graphdef, params = nnx.split(layers)
    else:
      graphdef, _ = nnx.split(layers[0])
      params = [nnx.split(layer)[1] for layer in layers]

    def one_unit(carry, unit_params):
      h, aux, index = carry
      rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
      unit = nnx.merge(graphdef, unit_params)
      h = unit(h, positions, segment_ids, rng)
      return (nn.with_logical_constraint(h, ACTIVATION_AXES), aux + _intermediates_sum(unit), index + 1), None

    # Under scan, CSE across iterations cannot happen, so prevent_cse (which costs fusion) is off.
    body = remat(one_unit, c.remat_policy, prevent_cse=not c.scan_layers)
    carry = (x, jnp.zeros((), jnp.float32), jnp.asarray(first_index, jnp.int32))
    if c.scan_layers:
      carry, _ = jax.lax.scan(body, carry, params)
    else:
      for unit_params in params:
        carry, _ = body(carry, unit_params)
    return carry[0], carry[1]
