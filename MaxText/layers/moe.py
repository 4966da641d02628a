"""Mixture of experts: a float32 router (softmax, or sigmoid with a selection bias as in DeepSeek V3;
group-limited choice as in DeepSeek V2/V3), top-k routing, gated expert MLPs and optional shared experts.

Dropless by default: the token->expert assignments are sorted by expert and each expert's contiguous
group goes through jax.lax.ragged_dot (moe_dispatch.dropless, per batch shard; over an `expert` axis the
assignments move to their experts' shards by all-to-all). capacity_factor > 0 gives each expert a fixed buffer of
C = ceil(capacity_factor * tokens * k / experts) slots (static, at most tokens): assignments are
scattered into an [E, C, D] buffer in token order (earlier tokens win), the experts run as one batched
einsum over it (E sharded over `expert`, C over the other batch axes) and the outputs are gathered
back; assignments beyond capacity are dropped (contribute 0, cost nothing). That is capacity_group=global;
sequence and shard count the capacity per sequence or per batch shard and dispatch per shard with
all-to-all over `expert` (moe_dispatch.capacity). The Switch-style
load-balancing loss E * sum_e(f_e * p_e) (f_e: assignments to e per token, p_e: mean router
probability of e) is recorded as an nnx.Intermediate, which the decoder collects into the objective. With a
selection bias (routed_bias) each expert's assignment count is recorded too (ExpertLoad, not a loss): the
train step moves the bias towards balance from it (DeepSeek V3's auxiliary-loss-free balancing).
Einsum letters: E experts, X tokens (B*T flattened), R routed slots per token (k), A assignments (X*k),
C capacity slots per expert, D model dim, F expert width.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import moe_dispatch
from MaxText.layers.axes import ACTIVATION_AXES, EXPERT_EMBED_AXES, EXPERT_MLP_AXES
from MaxText.layers.linears import DenseGeneral, weight
from MaxText.layers.mlp import ACTIVATIONS, MlpBlock
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.moe_dispatch import expert_capacity, expert_ranks
from MaxText.parallel import ops

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

# Tokens that share an expert's capacity: the whole batch, each sequence (MaxText), each batch shard.
CAPACITY_GROUPS = ("global", "sequence", "shard")


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


def route(logits: jax.Array, config: ModelConfig, bias: jax.Array | None = None) -> Routing:
  """logits [X, E] -> scores (routed_score_func, float32); experts chosen by scores + bias within the
  allowed groups; combine weights = their scores, renormalised (norm_topk_prob) and scaled."""
  m, logits = config.moe, logits.astype(jnp.float32)
  scores = jax.nn.sigmoid(logits) if m.routed_score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  choice = scores if bias is None else scores + bias.astype(jnp.float32)
  choice = group_limit(choice, m.n_routing_groups, m.topk_routing_group, m.routed_group_score)
  experts = jax.lax.top_k(choice, m.num_experts_per_tok)[1]
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if m.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  return Routing(experts.astype(jnp.int32), weights * m.routed_scaling_factor, probs)


class ExpertLoad(nnx.Intermediate):
  """int32 [E]: the assignments each expert got in the layer's last call (before any capacity drop). Not a
  loss: the decoder returns these apart (DecoderOutput.expert_load) and the train step nudges the router's
  gate_bias with them (train_step.balance_router_bias)."""


def expert_load(experts: jax.Array, num_experts: int) -> jax.Array:
  """experts [X, k] -> int32 [E]: how many of the X * k assignments went to each expert."""
  return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def load_balance_loss(routing: Routing, num_experts: int) -> jax.Array:
  """E * sum_e(f_e * p_e): 1 per routed slot when perfectly balanced."""
  counts = jnp.zeros((num_experts,), jnp.float32).at[routing.experts.reshape(-1)].add(1.0)
  fraction = counts / routing.experts.shape[0]
  return num_experts * jnp.sum(fraction * jnp.mean(routing.probs, axis=0))


def capacity_mask(experts: jax.Array, num_experts: int, capacity_factor: float) -> jax.Array:
  """[X, k] -> [X, k] bool: the assignment is within its expert's capacity (in token order)."""
  x, k = experts.shape
  return expert_ranks(experts, num_experts) < expert_capacity(x, k, num_experts, capacity_factor)


@dataclasses.dataclass(frozen=True)
class GatedUnit:
  """(gate, up) -> the experts' hidden activations: act(gate) * up (mlp_activations[0]), or with limit > 0
  gpt-oss's clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), where g = min(gate, limit) and up is clipped to
  [-limit, limit]. A value, not a closure: it is static data of the MoE module, and two builds of one config
  must give equal graphs."""

  activation: str
  limit: float
  alpha: float

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    if self.limit <= 0:
      return ACTIVATIONS[self.activation](gate) * up
    gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(self.alpha * gate))


def gated_unit(config: ModelConfig) -> GatedUnit:
  """The experts' gated unit for `config` (mlp_activations, mlp_activations_limit, swiglu_alpha)."""
  return GatedUnit(config.mlp.mlp_activations[0], config.moe.mlp_activations_limit, config.moe.swiglu_alpha)


def per_expert_weights(weights: jax.Array, experts: jax.Array, scale: jax.Array) -> jax.Array:
  """Combine weights [X, k] float32 times each chosen expert's own scale (scale [E]; Gemma 4's per_expert_scale)."""
  return weights * jnp.take(scale.astype(jnp.float32), experts, axis=0)


class Combine(nnx.Module):
  """expert outputs [X, k, D], combine weights [X, k] float32 -> [X, D] float32, their weighted sum.

  A module of its own (no parameters) only for its path, `<moe>/combine`: quantization rules pick matmuls
  by module path (layers/quantization.py), and this one, unlike the experts' around it, has no weight."""

  def __call__(self, out: jax.Array, weights: jax.Array) -> jax.Array:
    return jnp.einsum("XRD,XR->XD", out.astype(jnp.float32), weights)


class MoeBlock(nnx.Module):
  """x [B, T, D] -> [B, T, D]: sum over the token's top-k experts of weight * wo(act(wi_0 x) * wi_1 x) (with
  routed_weight_on_input: wo(act(wi_0 wx) * wi_1 wx)), plus the shared experts' MLP when shared_experts > 0.
  Expert width F: config.moe.moe_mlp_dim (scaled like mlp_dim); the shared experts are one MLP of width
  shared_experts * F, as in DeepSeek and MaxText. gpt-oss options: router_bias (a bias on the router logits),
  mlp_bias (each expert's biases wi_0_bias, wi_1_bias [E, F] and wo_bias [E, D]; dropless only) and the
  clamped SwiGLU (gated_unit). `per_expert_scale` (Gemma 4): a learned scale [E] per expert on its combine
  weights."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, per_expert_scale: bool = False):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    e, d, f = config.moe.num_experts, config.emb_dim, config.moe.moe_mlp_dim
    self.gate = DenseGeneral(
      d, e, ("embed", None), dtype=jnp.float32, weight_dtype=wdt, rngs=rngs, use_bias=config.moe.router_bias
    )
    self.gate_bias = nnx.Param(jnp.zeros((e,), wdt), out_sharding=(None,)) if config.moe.routed_bias else nnx.data(None)
    self.per_expert_scale = nnx.Param(jnp.ones((e,), wdt), out_sharding=(None,)) if per_expert_scale else nnx.data(None)
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=0)
    self.wi_0 = nnx.Param(init(rngs.params(), (e, d, f), wdt), out_sharding=("exp", "embed", "mlp"))
    self.wi_1 = nnx.Param(init(rngs.params(), (e, d, f), wdt), out_sharding=("exp", "embed", "mlp"))
    self.wo = nnx.Param(init(rngs.params(), (e, f, d), wdt), out_sharding=("exp", "mlp", "embed"))
    self.wi_0_bias = self.wi_1_bias = self.wo_bias = nnx.data(None)
    if config.mlp.mlp_bias:
      self.wi_0_bias = nnx.Param(jnp.zeros((e, f), wdt), out_sharding=("exp", "mlp"))
      self.wi_1_bias = nnx.Param(jnp.zeros((e, f), wdt), out_sharding=("exp", "mlp"))
      self.wo_bias = nnx.Param(jnp.zeros((e, d), wdt), out_sharding=("exp", "embed"))
    self.shared_experts = nnx.data(None)
    if config.moe.shared_experts:
      self.shared_experts = MlpBlock(config, rngs=rngs, mlp_dim=f * config.moe.shared_experts)
    self.shared_expert_gate = nnx.data(None)  # qwen3next: sigmoid(x . w) scales the shared experts' output
    if config.moe.shared_experts and config.moe.shared_expert_gate:
      self.shared_expert_gate = DenseGeneral(d, 1, ("embed", None), dtype=dt, weight_dtype=wdt, rngs=rngs)
    self.config, self.plan, self.num_experts, self.k, self.dtype = config, plan, e, config.moe.num_experts_per_tok, dt
    self.capacity_factor = config.moe.capacity_factor
    self.glu = gated_unit(config)
    self.combine = Combine()

  def __call__(self, x: jax.Array, route_from: jax.Array | None = None) -> jax.Array:
    """x [B, T, D] -> [B, T, D]; `route_from` [B, T, D]: what the router sees in place of x (Gemma 4)."""
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)  # [X, D]
    routing = self._route(tokens if route_from is None else route_from.reshape(b * t, -1))
    self.load_balance_loss = nnx.Intermediate(load_balance_loss(routing, self.num_experts))
    if self.gate_bias is not None:
      self.expert_load = ExpertLoad(expert_load(routing.experts, self.num_experts))
    weights = routing.weights
    if self.per_expert_scale is not None:
      weights = per_expert_weights(weights, routing.experts, self.per_expert_scale[...])
    if (
      self.config.moe.routed_weight_on_input
    ):  # llama4: the expert sees w * x (k = 1, checked at load), output unweighted
      tokens = (tokens.astype(jnp.float32) * weights).astype(tokens.dtype)
      weights = jnp.ones_like(weights)
    if self.capacity_factor > 0 and self.config.moe.capacity_group == "global":
      out = self._capacity_experts(tokens, routing.experts)  # [X, k, D], 0 where dropped
    elif self.capacity_factor > 0:
      out = self._grouped_capacity_experts(tokens, routing.experts, t)
    else:
      out = self._experts(tokens, routing.experts, t)  # [X, k, D]
    if self.wo_bias is not None:  # each assignment's expert adds its own output bias (dropless: none dropped)
      out = out + jnp.take(self.wo_bias[...].astype(out.dtype), routing.experts, axis=0)
    out = self.combine(out, weights).astype(self.dtype)
    out = out.reshape(b, t, d)
    if self.shared_experts is not None:
      shared = self.shared_experts(x)
      if self.shared_expert_gate is not None:
        shared = shared * jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32)).astype(shared.dtype)
      out = out + shared
    return nn.with_logical_constraint(out, ACTIVATION_AXES)

  def _route(self, tokens: jax.Array) -> Routing:
    """tokens [X, D] -> Routing, per batch shard under a mesh: the partitioner would all-gather the
    [X, E] scores of the whole batch for top_k (seen on XLA:CPU), and routing is per token anyway."""
    logits, config = self.gate(tokens), self.config
    rows = Routing(2, 2, 2)  # each output is [X, ...], split like the tokens
    if self.gate_bias is None:
      return ops.per_batch_shard(self.plan, lambda g: route(g, config), logits, out=rows)
    bias = self.gate_bias[...]
    return ops.per_batch_shard(self.plan, lambda g, b: route(g, config, b), logits, bias, out=rows)

  def _experts(self, tokens: jax.Array, experts: jax.Array, length: int) -> jax.Array:
    """tokens [X, D], experts [X, k] -> each assignment's expert output [X, k, D] (dropless).

    Under a mesh each batch shard sorts and computes its own tokens (shard_map over activation_batch's
    mesh axes, expert widths split over activation_mlp's with a psum of the partial outputs): a global
    sort would gather every routed token of the batch onto every device. With experts split over an
    `expert` axis (one of the batch axes), the tokens go to their experts' shards and back
    (moe_dispatch.dropless); the weights are never gathered across `expert`.
    """
    compute = functools.partial(moe_dispatch.dropless, num_experts=self.num_experts, glu=self.glu)
    compute = functools.partial(compute, ragged=self.plan.moe.ragged)
    return self._per_shard(compute, tokens, experts, length, whole_sequences=False)

  def _grouped_capacity_experts(self, tokens: jax.Array, experts: jax.Array, length: int) -> jax.Array:
    """Capacity counted per sequence or per batch shard (capacity_group), as MaxText counts it."""
    per_sequence = self.config.moe.capacity_group == "sequence"

    def compute(tokens, experts, *weights, **ep):
      groups = tokens.shape[0] // length if per_sequence else 1
      return moe_dispatch.capacity(
        tokens, experts, *weights, num_experts=self.num_experts, groups=groups,
        capacity_factor=self.capacity_factor, glu=self.glu, **ep,
      )  # fmt: skip

    return self._per_shard(compute, tokens, experts, length, per_sequence)

  def _weights(self) -> tuple[jax.Array, ...]:
    """wi_0, wi_1, wo (and wi_0_bias, wi_1_bias under mlp_bias) in the compute dtype. On TPU, a weight
    whose FSDP shard has a last dim under 128 lanes (mixtral's wo [E, F, D]: 64 of D per chip on v5p-128)
    keeps its larger dim minor: XLA hoists
    this cast of the whole layer stack out of the scanned loop, and with D minor libtpu 0.0.52 padded the
    copy to twice its bytes (896 instead of 448 MiB per chip for mixtral; sharding.lane_layout)."""
    params = (self.wi_0, self.wi_1, self.wo)
    weights = tuple(weight(p, self.dtype) for p in params)

    def keep_lanes(param: nnx.Param, w: jax.Array) -> jax.Array:
      # Inside the scanned stack the metadata still names the stacked dims (`layers`, leading) too.
      names = tuple(param.get_metadata().get("out_sharding") or ())[-w.ndim :]
      return ops.keep_lanes(self.plan, w, names)

    biases = tuple(weight(p, self.dtype) for p in (self.wi_0_bias, self.wi_1_bias) if p is not None)
    return tuple(keep_lanes(p, w) for p, w in zip(params, weights)) + biases

  def _per_shard(self, compute, tokens: jax.Array, experts: jax.Array, length: int, whole_sequences: bool):
    """compute(tokens, experts, wi_0, wi_1, wo, ep_axes=, ep=) per batch shard (parallel.ops.experts)."""
    rows = tokens.shape[0] // length if whole_sequences else tokens.shape[0]
    weights = self._weights()
    return ops.experts(self.plan, compute, tokens.astype(self.dtype), experts, weights, self.num_experts, rows)

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
    wi_0, wi_1, wo, *biases = self._weights()
    hidden = moe_dispatch.expert_hidden(buffer, wi_0, wi_1, self.glu, *biases)
    hidden = nn.with_logical_constraint(hidden, EXPERT_MLP_AXES)
    out = jnp.einsum("ECF,EFD->ECD", hidden, wo)
    out = nn.with_logical_constraint(out, EXPERT_EMBED_AXES)
    out = jnp.take(out.reshape(e * c, d), slots, axis=0, mode="fill", fill_value=0)  # [A, D]
    return out.reshape(x, k, d)
