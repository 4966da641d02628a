"""Mixture of experts: a float32 router (softmax, or sigmoid with a selection bias as in DeepSeek V3;
group-limited choice as in DeepSeek V2/V3), top-k routing, gated expert MLPs and optional shared experts.

Dropless by default: the token->expert assignments are sorted by expert and each expert's contiguous
group goes through jax.lax.ragged_dot. capacity_factor > 0 gives each expert a fixed buffer of
C = ceil(capacity_factor * tokens * k / experts) slots (static, at most tokens): assignments are
scattered into an [E, C, D] buffer in token order (earlier tokens win), the experts run as one batched
einsum over it (E sharded over `expert`, C over the other batch axes) and the outputs are gathered
back; assignments beyond capacity are dropped (contribute 0, cost nothing). The Switch-style
load-balancing loss E * sum_e(f_e * p_e) (f_e: assignments to e per token, p_e: mean router
probability of e) is recorded as an nnx.Intermediate, which the decoder collects into the objective.
Einsum letters: E experts, X tokens (B*T flattened), R routed slots per token (k), A assignments (X*k),
C capacity slots per expert, D model dim, F expert width.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from MaxText.config import Config
from MaxText.layers.axes import ACTIVATION_AXES, EXPERT_EMBED_AXES, EXPERT_MLP_AXES, MLP_AXES, axes_size, mesh_axes
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


def expert_capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
  """Slots per expert: ceil(capacity_factor * tokens * k / experts), at most `tokens` (a token picks an
  expert at most once, so more slots could never fill)."""
  return min(math.ceil(capacity_factor * tokens * k / num_experts), tokens)


def expert_ranks(experts: jax.Array, num_experts: int) -> jax.Array:
  """[X, k] expert ids -> [X, k] int32: each assignment's rank among its expert's assignments in
  (token, slot) order, so earlier tokens come first. A stable sort, no [A, E] one-hot."""
  flat = experts.reshape(-1)  # [A]
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts)
  starts = jnp.cumsum(sizes) - sizes  # first sorted position of each expert's group
  ranks = jnp.arange(flat.shape[0]) - starts[flat[order]]
  return jnp.zeros_like(flat).at[order].set(ranks).reshape(experts.shape)


def capacity_mask(experts: jax.Array, num_experts: int, capacity_factor: float) -> jax.Array:
  """[X, k] -> [X, k] bool: the assignment is within its expert's capacity (in token order)."""
  x, k = experts.shape
  return expert_ranks(experts, num_experts) < expert_capacity(x, k, num_experts, capacity_factor)


def ragged_experts(
  tokens: jax.Array, experts: jax.Array, wi_0: jax.Array, wi_1: jax.Array, wo: jax.Array, *, num_experts: int,
  activation,
) -> jax.Array:  # fmt: skip
  """tokens [X, D], experts [X, k], weights [E, D, F] / [E, F, D] -> [X, k, D]: the assignments sorted
  by expert, each expert's contiguous group through jax.lax.ragged_dot, then put back in order."""
  x, k = experts.shape
  flat = experts.reshape(-1)  # [A]
  order = jnp.argsort(flat, stable=True)
  sorted_tokens = jnp.take(tokens, order // k, axis=0)  # [A, D], grouped by expert
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  hidden = activation(jax.lax.ragged_dot(sorted_tokens, wi_0, sizes)) * jax.lax.ragged_dot(sorted_tokens, wi_1, sizes)
  out = jax.lax.ragged_dot(hidden, wo, sizes)  # [A, D]
  return jnp.zeros_like(out).at[order].set(out).reshape(x, k, -1)


class MoeBlock(nnx.Module):
  """x [B, T, D] -> [B, T, D]: sum over the token's top-k experts of weight * wo(act(wi_0 x) * wi_1 x),
  plus the shared experts' MLP when shared_experts > 0. Expert width F: config.moe_mlp_dim (scaled like
  mlp_dim); the shared experts are one MLP of width shared_experts * F, as in DeepSeek and MaxText."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    e, d, f = config.num_experts, config.emb_dim, config.moe_mlp_dim
    self.gate = DenseGeneral(d, e, ("embed", None), dtype=jnp.float32, weight_dtype=wdt, rngs=rngs)
    self.gate_bias = nnx.Param(jnp.zeros((e,), wdt), out_sharding=(None,)) if config.routed_bias else nnx.data(None)
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=0)
    self.wi_0 = nnx.Param(init(rngs.params(), (e, d, f), wdt), out_sharding=("exp", "embed", "mlp"))
    self.wi_1 = nnx.Param(init(rngs.params(), (e, d, f), wdt), out_sharding=("exp", "embed", "mlp"))
    self.wo = nnx.Param(init(rngs.params(), (e, f, d), wdt), out_sharding=("exp", "mlp", "embed"))
    self.shared_experts = nnx.data(None)
    if config.shared_experts:
      self.shared_experts = MlpBlock(config, rngs=rngs, mlp_dim=f * config.shared_experts)
    self.config, self.num_experts, self.k, self.dtype = config, e, config.num_experts_per_tok, dt
    self.capacity_factor = config.capacity_factor
    self.activation = ACTIVATIONS[config.mlp_activations[0]]

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)  # [X, D]
    routing = route(self.gate(tokens), self.config, None if self.gate_bias is None else self.gate_bias[...])
    self.load_balance_loss = nnx.Intermediate(load_balance_loss(routing, self.num_experts))
    if self.capacity_factor > 0:
      out = self._capacity_experts(tokens, routing.experts)  # [X, k, D], 0 where dropped
    else:
      out = self._experts(tokens, routing.experts)  # [X, k, D]
    out = jnp.einsum("XRD,XR->XD", out.astype(jnp.float32), routing.weights).astype(self.dtype)
    out = out.reshape(b, t, d)
    if self.shared_experts is not None:
      out = out + self.shared_experts(x)
    return nn.with_logical_constraint(out, ACTIVATION_AXES)

  def _experts(self, tokens: jax.Array, experts: jax.Array) -> jax.Array:
    """tokens [X, D], experts [X, k] -> each assignment's expert output [X, k, D] (dropless).

    Under a mesh each batch shard sorts and computes its own tokens (shard_map over activation_batch's
    mesh axes, expert widths split over activation_mlp's with a psum of the partial outputs): a global
    sort would gather every routed token of the batch onto every device. Experts split over an
    `expert` axis keep the global path (their tokens must move between shards).
    """
    weights = tuple(w[...].astype(self.dtype) for w in (self.wi_0, self.wi_1, self.wo))
    compute = functools.partial(ragged_experts, num_experts=self.num_experts, activation=self.activation)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh_axes("activation_exp", EXPERT_EMBED_AXES, mesh):
      return compute(tokens.astype(self.dtype), experts, *weights)
    batch = mesh_axes("activation_batch", ACTIVATION_AXES, mesh)
    batch = batch if tokens.shape[0] % axes_size(batch, mesh) == 0 else ()
    mlp = mesh_axes("activation_mlp", MLP_AXES, mesh)
    mlp = mlp if weights[0].shape[-1] % axes_size(mlp, mesh) == 0 else ()

    def shard(tokens, experts, wi_0, wi_1, wo):
      out = compute(tokens.astype(self.dtype), experts, wi_0, wi_1, wo)
      return jax.lax.psum(out, mlp) if mlp else out  # each shard of F gives a partial sum over F

    b, f = batch or None, mlp or None
    return jax.shard_map(
      shard,
      mesh=mesh,
      in_specs=(P(b, None), P(b, None), P(None, None, f), P(None, None, f), P(None, f, None)),
      out_specs=P(b, None, None),
    )(tokens, experts, *weights)

  def _capacity_experts(self, tokens: jax.Array, experts: jax.Array) -> jax.Array:
    """tokens [X, D], experts [X, k] -> [X, k, D]: each kept assignment's expert output, 0 for the
    assignments beyond their expert's capacity, which are never computed."""
    x, k = experts.shape
    e, d = self.num_experts, tokens.shape[-1]
    c = expert_capacity(x, k, e, self.capacity_factor)
    ranks = expert_ranks(experts, e)
    # Slot of each assignment in the flattened [E * C] buffer; dropped ones point past its end, where
    # the scatter discards them and the gather reads 0.
    slots = jnp.where(ranks < c, experts * c + ranks, e * c).reshape(-1)  # [A]
    routed = jnp.repeat(tokens.astype(self.dtype), k, axis=0)  # [A, D], assignment order
    buffer = jnp.zeros((e * c, d), self.dtype).at[slots].set(routed, mode="drop").reshape(e, c, d)
    buffer = nn.with_logical_constraint(buffer, EXPERT_EMBED_AXES)
    wi_0, wi_1, wo = (w[...].astype(self.dtype) for w in (self.wi_0, self.wi_1, self.wo))
    hidden = self.activation(jnp.einsum("ECD,EDF->ECF", buffer, wi_0)) * jnp.einsum("ECD,EDF->ECF", buffer, wi_1)
    hidden = nn.with_logical_constraint(hidden, EXPERT_MLP_AXES)
    out = jnp.einsum("ECF,EFD->ECD", hidden, wo)
    out = nn.with_logical_constraint(out, EXPERT_EMBED_AXES)
    out = jnp.take(out.reshape(e * c, d), slots, axis=0, mode="fill", fill_value=0)  # [A, D]
    return out.reshape(x, k, d)
