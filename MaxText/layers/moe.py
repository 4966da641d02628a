"""Mixture of experts: a float32 router (softmax, or sigmoid with a selection bias as in DeepSeek V3;
group-limited choice as in DeepSeek V2/V3), top-k routing, gated expert MLPs and optional shared experts.

Dropless by default: the token->expert assignments are sorted by expert and each expert's contiguous
group goes through jax.lax.ragged_dot. capacity_factor > 0 drops, per expert, the assignments beyond
capacity = ceil(capacity_factor * tokens * k / experts) (earlier tokens win). The Switch-style
load-balancing loss E * sum_e(f_e * p_e) (f_e: assignments to e per token, p_e: mean router
probability of e) is recorded as an nnx.Intermediate, which the decoder collects into the objective.
Einsum letters: E experts, X tokens (B*T flattened), R routed slots per token (k), A assignments (X*k).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.config import Config
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.mlp import ACTIVATIONS, MlpBlock


class Routing(NamedTuple):
  experts: jax.Array  # [X, k] int32 expert ids
  weights: jax.Array  # [X, k] float32 combine weights (renormalised top-k probabilities)
  probs: jax.Array  # [X, E] float32 router probabilities


def group_limit(choice: jax.Array, groups: int, top_groups: int, score: str = "top2_sum") -> jax.Array:
  """choice [X, E] -> the same with experts outside each token's `top_groups` best groups at -inf; a
  group's score is the sum of its two best experts (score=top2_sum, DeepSeek V3) or its best expert
  (score=max, DeepSeek V2's group_limited_greedy)."""
  if groups <= 1:
    return choice
  x, e = choice.shape
  grouped = choice.reshape(x, groups, e // groups)
  if score == "max":
    group_scores = jnp.max(grouped, axis=-1)  # [X, groups]
  else:
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  keep = jax.nn.one_hot(jax.lax.top_k(group_scores, top_groups)[1], groups).sum(axis=1) > 0
  return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(x, e)


def route(logits: jax.Array, config: Config, bias: jax.Array | None = None) -> Routing:
  """logits [X, E] -> scores (routed_score_func, float32); experts chosen by scores + bias within the
  allowed groups; combine weights = their scores, renormalised (norm_topk_prob) and scaled."""
  logits = logits.astype(jnp.float32)
  scores = jax.nn.sigmoid(logits) if config.routed_score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  choice = group_limit(choice, config.n_routing_groups, config.topk_routing_group, config.routed_group_score)
  experts = jax.lax.top_k(choice, config.num_experts_per_tok)[1]
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if config.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  return Routing(experts.astype(jnp.int32), weights * config.routed_scaling_factor, probs)


def load_balance_loss(routing: Routing, num_experts: int) -> jax.Array:
  """E * sum_e(f_e * p_e): 1 per routed slot when perfectly balanced."""
  counts = jnp.zeros((num_experts,), jnp.float32).at[routing.experts.reshape(-1)].add(1.0)
  fraction = counts / routing.experts.shape[0]
  return num_experts * jnp.sum(fraction * jnp.mean(routing.probs, axis=0))


def capacity_mask(experts: jax.Array, num_experts: int, capacity_factor: float) -> jax.Array:
  """[X, k] -> [X, k] bool: the assignment is within its expert's capacity (in token order)."""
  x, k = experts.shape
  capacity = math.ceil(capacity_factor * x * k / num_experts)
  one_hot = jax.nn.one_hot(experts.reshape(-1), num_experts, dtype=jnp.int32)  # [A, E]
  position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)  # rank within its expert
  return (position < capacity).reshape(x, k)


class MoeBlock(nnx.Module):
  """x [B, T, D] -> [B, T, D]: sum over the token's top-k experts of weight * wo(act(wi_0 x) * wi_1 x),
  plus the shared experts' MLP when shared_experts > 0. Expert width: base_moe_mlp_dim or mlp_dim."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    e, d, f = config.num_experts, config.emb_dim, config.base_moe_mlp_dim or config.mlp_dim
    self.gate = DenseGeneral(d, e, ("embed", None), dtype=jnp.float32, weight_dtype=wdt, rngs=rngs)
    self.gate_bias = nnx.Param(jnp.zeros((e,), wdt), out_sharding=(None,)) if config.routed_bias else nnx.data(None)
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=0)
    self.wi_0 = nnx.Param(init(rngs.params(), (e, d, f), wdt), out_sharding=("exp", "embed", "mlp"))
    self.wi_1 = nnx.Param(init(rngs.params(), (e, d, f), wdt), out_sharding=("exp", "embed", "mlp"))
    self.wo = nnx.Param(init(rngs.params(), (e, f, d), wdt), out_sharding=("exp", "mlp", "embed"))
    self.shared_experts = nnx.data(None)
    if config.shared_experts:
      self.shared_experts = MlpBlock(config.replace(base_mlp_dim=f * config.shared_experts), rngs=rngs)
    self.config, self.num_experts, self.k, self.dtype = config, e, config.num_experts_per_tok, dt
    self.capacity_factor = config.capacity_factor
    self.activation = ACTIVATIONS[config.mlp_activations[0]]

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)  # [X, D]
    routing = route(self.gate(tokens), self.config, None if self.gate_bias is None else self.gate_bias[...])
    self.load_balance_loss = nnx.Intermediate(load_balance_loss(routing, self.num_experts))
    weights = routing.weights
    if self.capacity_factor > 0:
      weights = jnp.where(capacity_mask(routing.experts, self.num_experts, self.capacity_factor), weights, 0.0)
    out = self._experts(tokens, routing.experts)  # [X, k, D]
    out = jnp.einsum("XRD,XR->XD", out.astype(jnp.float32), weights).astype(self.dtype)
    out = out.reshape(b, t, d)
    if self.shared_experts is not None:
      out = out + self.shared_experts(x)
    return nn.with_logical_constraint(out, ("activation_batch", "activation_length", "activation_embed"))

  def _experts(self, tokens: jax.Array, experts: jax.Array) -> jax.Array:
    """tokens [X, D], experts [X, k] -> each assignment's expert output [X, k, D] (dropless)."""
    x, k = experts.shape
    flat = experts.reshape(-1)  # [A]
    order = jnp.argsort(flat, stable=True)
    sorted_tokens = jnp.take(tokens, order // k, axis=0).astype(self.dtype)  # [A, D], grouped by expert
    sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
    wi_0, wi_1, wo = (w[...].astype(self.dtype) for w in (self.wi_0, self.wi_1, self.wo))
    hidden = self.activation(jax.lax.ragged_dot(sorted_tokens, wi_0, sizes)) * jax.lax.ragged_dot(
      sorted_tokens, wi_1, sizes
    )
    hidden = nn.with_logical_constraint(hidden, (None, "activation_mlp"))
    out = jax.lax.ragged_dot(hidden, wo, sizes)  # [A, D]
    return jnp.zeros_like(out).at[order].set(out).reshape(x, k, -1)
