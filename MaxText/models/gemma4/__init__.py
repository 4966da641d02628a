"""Gemma 4 (text): sliding-window layers with every full_attention_interval-th layer full (global) attention;
the full layers have their own head dim and kv-head count (global_head_dim, global_num_kv_heads), "proportional"
RoPE (rope_type) and, with attention_k_eq_v, no value projection (V is the key projection). Weighted q/k norms, a
weightless v norm, attention scale 1, RMSNorm x * w (not Gemma 1-3's 1 + w), pre+post norms around both
sublayers and a per-layer scalar on each layer's output. kv-sharing (num_kv_shared_layers): the last layers
compute only queries and attend to the keys/values of the last earlier layer of their kind (sliding or full), with
MLPs twice as wide under use_double_wide_mlp; those layers and the cycle before them form one unrolled unit.
Per-layer embeddings (hidden_size_per_layer_input > 0): an input per layer from the tokens and the embeddings
(PerLayerInputs), gated into each layer's output after its MLP. MoE (num_experts > 1): beside the dense MLP, an
MoeBlock routed from its own scaled norm of the layer's input, with a scale per expert and extra norms around both
branches (Gemma4MoE)."""

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
from MaxText.layers.decoder import Family, LayerBlock, Stack, alternating_stacks
from MaxText.layers.decoder_layer import DecoderLayer
from MaxText.layers.embeddings import Embed, apply_rope
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.mlp import ACTIVATIONS, MlpBlock
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.moe import MoeBlock
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

  def __init__(
    self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, k_eq_v: bool = False, shares_kv: bool = False,
    **kwargs: Any,
  ):  # fmt: skip
    super().__init__(config, rngs=rngs, plan=plan, **{**kwargs, "norm": RMSNorm, "use_qk_norm": True})
    if k_eq_v or shares_kv:
      self.value = nnx.data(None)
    if shares_kv:  # queries only: keys and values come from an earlier layer
      self.key = self.key_norm = nnx.data(None)
    args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
    self.value_norm = UnitRMSNorm(config.head_dim, weight_dtype=jnp.dtype(config.weight_dtype), **args)
    self.rotary_dim = config.head_dim  # partial_rotary_factor is the proportional RoPE's only
    self.query_scale = 1.0

  def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    k = nn.with_logical_constraint(checkpoint_name(self.key(x), "key_proj"), KV_HEAD_AXES)
    v = k if self.value is None else checkpoint_name(self.value(x), "value_proj")
    k, v = self.key_norm(k), self.value_norm(v)
    return self.project_query(x, positions), self.rope(k, positions), v

  def project_query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    q = nn.with_logical_constraint(checkpoint_name(self.query(x), "query_proj"), HEAD_AXES)
    return self.rope(self.query_norm(q), positions)

  def attend_sharing(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: Any = None,
    shared: tuple[jax.Array, jax.Array] | None = None, decoding: bool = False,
  ) -> tuple[jax.Array, Any, tuple[jax.Array, jax.Array]]:  # fmt: skip
    """(out [B, T, D], the updated cache, the keys and values attended: [B, T, K, H] in training, the whole
    cache's [B, S, K, H] when decoding). `shared`: an earlier layer's keys and values, attended in place of
    this layer's own (kv-sharing; `decoding`: they are a cache's)."""
    if shared is None:
      q, k, v, cache = self.queries_keys_values(x, positions, cache)
    else:
      q, (k, v) = self.project_query(x, positions), shared
    return self.attend(q, k, v, positions, segment_ids, decoding or cache is not None), cache, (k, v)

  def rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    if self.rope_type != "proportional":
      return super().rope(x, positions)
    fraction = self.config.rope.partial_rotary_factor
    return apply_rope(x, positions, proportional_frequencies(x.shape[-1], fraction, self.rope_max_timescale))


def layer_config(config: ModelConfig, full: bool, shares_kv: bool) -> ModelConfig:
  """The config a layer is built from: a full-attention layer's own head dim and kv-head count; a kv-sharing
  layer's MLP twice as wide under use_double_wide_mlp."""
  a, changes = config.attention, {}
  if full:
    changes = dict(
      head_dim=a.global_head_dim or config.head_dim, num_kv_heads=a.global_num_kv_heads or config.num_kv_heads
    )
  if shares_kv and config.mlp.use_double_wide_mlp:
    changes["mlp_dim"] = 2 * config.mlp_dim
  return dataclasses.replace(config, **changes) if changes else config


class Gemma4MoE(nnx.Module):
  """Gemma 4's MoE branch, beside the dense MLP. x (the feed-forward's input, before any norm) -> the MoeBlock
  on pre_norm(x), routed from router_norm(x) * D^-0.5 (RMSNorm x * w: transformers' router.scale) with softmax
  top-k renormalised and a scale per expert; its output normed by post_norm."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan):
    args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
    args["weight_dtype"] = jnp.dtype(config.weight_dtype)
    d = config.emb_dim
    self.router_norm, self.pre_norm, self.post_norm = (RMSNorm(d, **args) for _ in range(3))
    self.experts = MoeBlock(config, rngs=rngs, plan=plan, per_expert_scale=True)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.post_norm(self.experts(self.pre_norm(x), route_from=self.route_input(x)))

  def route_input(self, x: jax.Array) -> jax.Array:
    return self.router_norm(x) * jnp.asarray(x.shape[-1] ** -0.5, x.dtype)


class Gemma4Layer(DecoderLayer):
  """A Gemma 4 decoder layer (`full`: global attention, else sliding-window; `shares_kv`: attends to an earlier
  layer's keys and values), its output times `layer_scalar`. With num_experts > 1 the feed-forward is
  post_ffw_norm(post_mlp_norm(mlp(pre-MLP norm(x))) + moe(x)) (Gemma4MoE)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, full: bool, shares_kv: bool = False):
    own = layer_config(config, full, shares_kv)
    attention = functools.partial(
      Gemma4Attention, shares_kv=shares_kv, k_eq_v=full and config.attention.attention_k_eq_v
    )
    blocks = dict(norm=RMSNorm, attention=attention, mlp=MlpBlock)  # the MoE branch is Gemma4MoE, beside it
    if full:
      super().__init__(own, rngs=rngs, plan=plan, sliding_window=0, **blocks)
    else:
      local = dict(rope_max_timescale=config.rope.local_rope_max_timescale, rope_type="default")
      super().__init__(own, rngs=rngs, plan=plan, **blocks, **local)
    self.moe = self.post_mlp_norm = nnx.data(None)
    if config.moe.num_experts > 1:
      self.moe = Gemma4MoE(own, rngs=rngs, plan=plan)
      eps, dt, wdt = config.norms.normalization_layer_epsilon, jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
      self.post_mlp_norm = RMSNorm(config.emb_dim, epsilon=eps, dtype=dt, weight_dtype=wdt)
    self.layer_scalar = nnx.Param(jnp.ones((1,), jnp.dtype(config.weight_dtype)), out_sharding=("norm",))
    self.full, self.shares_kv = full, shares_kv
    self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = nnx.data(None)
    if p := config.embed.hidden_size_per_layer_input:
      dt, wdt, d = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype), config.emb_dim
      dense = dict(dtype=dt, weight_dtype=wdt, rngs=rngs)
      self.per_layer_input_gate = DenseGeneral(d, p, ("embed", "mlp"), **dense)
      self.per_layer_projection = DenseGeneral(p, d, ("mlp", "embed"), **dense)
      eps = config.norms.normalization_layer_epsilon
      self.post_per_layer_input_norm = RMSNorm(d, epsilon=eps, dtype=dt, weight_dtype=wdt)
      self.activation = ACTIVATIONS[config.mlp.mlp_activations[0]]

  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None, cache: Any = None,
    layer_inputs: jax.Array | None = None,
  ) -> tuple[jax.Array, Any]:  # fmt: skip
    x, cache, _ = self.run(x, positions, segment_ids, rng, cache, layer_inputs=layer_inputs)
    return x, cache

  def run(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None, cache: Any = None,
    shared: tuple[jax.Array, jax.Array] | None = None, decoding: bool = False, layer_inputs: jax.Array | None = None,
  ) -> tuple[jax.Array, Any, tuple[jax.Array, jax.Array]]:  # fmt: skip
    """The layer, also returning the keys and values its attention attended (Gemma4Attention.attend_sharing);
    `layer_inputs` [B, T, P]: its per-layer embedding input (PerLayerInputs)."""
    attend = functools.partial(self.self_attention.attend_sharing, shared=shared, decoding=decoding)
    x, cache, kv = self.around(x, rng, lambda h: attend(h, positions, segment_ids, cache))
    if self.per_layer_input_gate is not None:  # no layer_inputs: LoRA's tracing call (lora.add_adapters)
      own = jnp.zeros((*x.shape[:-1], self.per_layer_input_gate.out_features[0]), x.dtype)
      own = own if layer_inputs is None else layer_inputs.astype(x.dtype)
      h = self.activation(self.per_layer_input_gate(x)) * own
      x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
    return x * self.layer_scalar[...].astype(x.dtype), cache, kv

  def feed_forward(self, x: jax.Array) -> jax.Array:
    """The dense MLP's output, with the MoE branch added beside it (post_mlp_norm on the MLP's) when there is one."""
    h = self.mlp(self.post_self_attention_layer_norm(x))
    if self.moe is not None:
      h = self.post_mlp_norm(h) + self.moe(x)
    return h if self.post_ffw_norm is None else self.post_ffw_norm(h)

  def init_cache(self, batch: int, length: int) -> Any:
    return None if self.shares_kv else super().init_cache(batch, length)


class SharedKVBlock(LayerBlock):
  """The kv-sharing layers with the cycle of layers before them, as one unit: each sharing layer attends to the
  keys and values of the last layer of its kind (full or sliding) that computed its own."""

  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None, cache: Any = None,
    layer_inputs: jax.Array | None = None,
  ) -> tuple[jax.Array, Any]:  # fmt: skip
    shared, new_cache = {}, []
    for i, layer in enumerate(self.sublayers):
      layer_rng = None if rng is None else jax.random.fold_in(rng, i)
      layer_cache = None if cache is None else cache[i]
      kv = shared.get(layer.full) if layer.shares_kv else None
      own = None if layer_inputs is None else layer_inputs[i]
      x, layer_cache, kv = layer.run(x, positions, segment_ids, layer_rng, layer_cache, kv, cache is not None, own)
      if not layer.shares_kv:
        shared[layer.full] = kv
      new_cache.append(layer_cache)
    return x, None if cache is None else tuple(new_cache)


def stacks(config: ModelConfig) -> tuple[Stack, ...]:
  """Cycles of full_attention_interval - 1 sliding layers and one full layer; with num_kv_shared_layers, the last
  cycle before the sharing layers and those layers form one SharedKVBlock (models.problem checks the counts)."""
  period, shared = config.linear.full_attention_interval, config.attention.num_kv_shared_layers
  pattern = tuple(functools.partial(Gemma4Layer, full=(i + 1) % period == 0) for i in range(period))
  if not shared:
    return alternating_stacks(config, pattern)
  first = config.num_decoder_layers - shared
  sharing = tuple(
    functools.partial(Gemma4Layer, full=(i + 1) % period == 0, shares_kv=True) for i in range(first, first + shared)
  )
  out = (
    [Stack("layers", functools.partial(LayerBlock, makers=pattern), first // period - 1, period)]
    if first > period
    else []
  )
  block = functools.partial(SharedKVBlock, makers=pattern + sharing)
  return (*out, Stack("shared_kv_layers", block, 1, period + shared))


class PerLayerInputs(nnx.Module):
  """Per-layer embeddings: (tokens [B, T], the scaled embeddings x [B, T, D]) -> [L, B, T, P], per layer the mean
  (times sqrt 2) of its slice of a second token embedding (times sqrt P) and of a projection of x (times D^-1/2,
  RMS-normed over P)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    self.layers, self.dim = config.num_decoder_layers, config.embed.hidden_size_per_layer_input
    self.vocab = config.embed.vocab_size_per_layer_input
    width = self.layers * self.dim
    self.embedder = Embed(self.vocab, width, dtype=dt, weight_dtype=wdt, rngs=rngs)
    self.projection = DenseGeneral(config.emb_dim, width, ("embed", "mlp"), dtype=dt, weight_dtype=wdt, rngs=rngs)
    eps = config.norms.normalization_layer_epsilon
    self.norm = RMSNorm(self.dim, epsilon=eps, dtype=dt, weight_dtype=wdt)

  def __call__(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
    shape = (*tokens.shape, self.layers, self.dim)
    embedded = self.embedder(jnp.where(tokens < self.vocab, tokens, 0)).reshape(shape)
    embedded = embedded * jnp.asarray(self.dim**0.5, embedded.dtype)
    projected = self.projection(x) * jnp.asarray(x.shape[-1] ** -0.5, x.dtype)
    out = (self.norm(projected.reshape(shape)) + embedded) * jnp.asarray(2.0**-0.5, x.dtype)
    return jnp.moveaxis(out, 2, 0)


def layer_inputs(config: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module | None:
  return PerLayerInputs(config, rngs=rngs) if config.embed.hidden_size_per_layer_input else nnx.data(None)


FAMILY = Family(stacks=stacks, norm=RMSNorm, scale_embeddings=True, layer_inputs=layer_inputs)
