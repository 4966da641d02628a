"""Qwen3-Next's and Qwen3.5's two token mixers: the gated DeltaNet (linear attention with a short causal
convolution and a decaying matrix state updated by the delta rule) and gated full attention (a sigmoid output
gate per query channel, RoPE on the first partial_rotary_factor of each head).

Gated delta rule, per value head, state S [Dk, Dv], for each token t (q, k L2-normalised, q scaled by Dk^-0.5):
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
Training and prefill run it in chunks of linear_chunk_size tokens (the WY/UT form: within a chunk, a unit
lower-triangular solve turns the sequential updates into matmuls; a lax.scan carries S from chunk to chunk).
Decoding one token per step runs the recurrence itself. The decode cache is the recurrent state: the last
K - 1 convolution inputs and S, of fixed size whatever the length.

Packed sequences: the convolution does not reach across segments and S is decayed by exp(-30) (~1e-13) at
each segment's first token. Padding (segment 0, the decode prefill's right padding) leaves S unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import kv_cache
from MaxText.layers.attention import Attention, attend, dot_product_attention
from MaxText.layers.axes import HEAD_AXES
from MaxText.layers.embeddings import apply_rope, rope_attention_factor, scaled_rope_frequencies
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

SEGMENT_START_DECAY = -30.0  # log decay of the state at a packed segment's first token


class RecurrentState(NamedTuple):
  """A gated DeltaNet layer's decode cache."""

  conv: jax.Array  # [B, K - 1, C] the last K - 1 inputs of the causal convolution (C = 2 Hk Dk + Hv Dv)
  ssm: jax.Array  # [B, Hv, Dk, Dv] float32: the delta-rule state S


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
  """The recurrence token by token: q/k [B, T, H, Dk], v [B, T, H, Dv], g/beta [B, T, H], state [B, H, Dk, Dv]
  (all float32, q already scaled) -> (out [B, T, H, Dv], final state)."""

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t = xs
    s = s * jnp.exp(g_t)[..., None, None]
    delta = (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, s)) * b_t[..., None]
    s = s + k_t[..., None] * delta[..., None, :]
    return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
  state, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int):
  """The same maths in chunks of `chunk` tokens (T padded up to a multiple with inert tokens: g = beta = k = 0)."""
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  pad = -t % chunk
  if pad:
    q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
    g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
  n = (t + pad) // chunk

  def chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...]
    a = a.reshape(b, n, chunk, h, *a.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(a, 3, 2), 1, 0)

  q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
  k_beta, v_beta = k * beta[..., None], v * beta[..., None]
  cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]: log decay from the chunk start to each token
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [.., C, C], i >= j
  strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
  system = jnp.where(strict, jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay, 0.0) + jnp.eye(chunk)
  rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
  solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
  new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
  intra = jnp.einsum("...ik,...jk->...ij", q, k) * decay
  q_decayed = q * jnp.exp(cum)[..., None]
  k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [N, B, H, 1, 1]

  def step(s, xs):
    nv, kc, qd, kd, a, cd = xs
    v_new = nv - kc @ s
    out = qd @ s + a @ v_new
    return s * cd + jnp.swapaxes(kd, -1, -2) @ v_new, out

  state, out = jax.lax.scan(step, state, (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
  out = jnp.moveaxis(jnp.moveaxis(out, 0, 1), 2, 3).reshape(b, n * chunk, h, dv)  # [B, T, H, Dv]
  return out[:, :t], state


class GatedRMSNorm(nnx.Module):
  """RMSNorm over the last dim (weight w, initialised at 1), then times silu(gate), in float32."""

  def __init__(self, dim: int, *, epsilon: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), out_sharding=("norm",))
    self.epsilon, self.dtype = epsilon, dtype

  def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)).astype(x.dtype)
    y = self.scale[...].astype(jnp.float32) * y.astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(self.dtype)


class GatedDeltaNet(nnx.Module):
  """x [B, T, D] -> [B, T, D]: the linear-attention token mixer (the DecoderLayer attention contract; the
  keyword arguments of softmax attention it does not use are accepted and ignored).

  Projections are kept in Hugging Face's fused, per-key-head-grouped layout so that checkpoints convert
  without reordering: in_proj_qkvz [D, Hk, 2 Dk + 2 (Hv/Hk) Dv] (q, k, then the group's v and z heads),
  in_proj_ba [D, Hk, 2 Hv/Hk], conv1d [C, 1, K] (depthwise), A_log and dt_bias [Hv], norm [Dv], out [Hv, Dv, D].
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, **_: Any):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    d = config.emb_dim
    self.hk, self.hv = config.linear.linear_num_key_heads, config.linear.linear_num_value_heads
    self.dk, self.dv = config.linear.linear_key_head_dim, config.linear.linear_value_head_dim
    self.kernel_size, self.chunk = config.linear.linear_conv_kernel_dim, config.linear.linear_chunk_size
    self.ratio = self.hv // self.hk
    self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
    self._projections(d, dict(dtype=dt, weight_dtype=wdt, rngs=rngs))
    fan_in = nnx.initializers.lecun_normal(in_axis=-1, out_axis=0)
    self.conv1d = nnx.Param(fan_in(rngs.params(), (self.conv_dim, 1, self.kernel_size), wdt), out_sharding=(None,) * 3)
    self.dt_bias = nnx.Param(jnp.ones((self.hv,), wdt), out_sharding=(None,))
    a = jax.random.uniform(rngs.params(), (self.hv,), jnp.float32, 1.0, 16.0)
    self.A_log = nnx.Param(jnp.log(a).astype(wdt), out_sharding=(None,))
    self.norm = GatedRMSNorm(self.dv, epsilon=config.norms.normalization_layer_epsilon, dtype=dt, weight_dtype=wdt)
    self.out = DenseGeneral((self.hv, self.dv), d, ("heads", "kv", "embed"), dtype=dt, weight_dtype=wdt, rngs=rngs)
    self.dtype = dt

  def _projections(self, d: int, dense: dict[str, Any]) -> None:
    group = 2 * self.dk + 2 * self.ratio * self.dv
    self.in_proj_qkvz = DenseGeneral(d, (self.hk, group), ("embed", "q_heads", "kv"), **dense)
    self.in_proj_ba = DenseGeneral(d, (self.hk, 2 * self.ratio), ("embed", "q_heads", None), **dense)

  def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> (the convolution's input [B, T, C]: all q heads, all k heads, all v heads; z [B, T, Hv, Dv];
    the beta and decay logits [B, T, Hv])."""
    b, t, _ = x.shape
    dk, dv, r = self.dk, self.dv, self.ratio
    qkvz = self.in_proj_qkvz(x)  # [B, T, Hk, G]
    ba = self.in_proj_ba(x)  # [B, T, Hk, 2r]
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    z = z.reshape(b, t, self.hv, dv)
    beta_logit, a = (u.reshape(b, t, self.hv) for u in jnp.split(ba, 2, axis=-1))
    mixed = jnp.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], axis=-1)
    return mixed, z, beta_logit, a

  def _conv(self, mixed: jax.Array, segment_ids: jax.Array, history: jax.Array) -> jax.Array:
    """Depthwise causal convolution + silu: mixed [B, T, C] after `history` [B, K-1, C] -> [B, T, C]."""
    k, t = self.kernel_size, mixed.shape[1]
    full = jnp.concatenate([history.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    seg = jnp.concatenate([jnp.broadcast_to(segment_ids[:, :1], (mixed.shape[0], k - 1)), segment_ids], axis=1)
    w = self.conv1d[...].astype(jnp.float32)[:, 0, :]  # [C, K]
    out = jnp.zeros(mixed.shape, jnp.float32)
    for j in range(k):  # tap j reads the input k - 1 - j places back
      same = (seg[:, j : j + t] == segment_ids)[..., None]
      out = out + jnp.where(same, full[:, j : j + t].astype(jnp.float32), 0.0) * w[:, j]
    return jax.nn.silu(out).astype(mixed.dtype)

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    rng: jax.Array | None = None,
    cache: RecurrentState | None = None,
  ) -> tuple[jax.Array, RecurrentState | None]:
    b, t, _ = x.shape
    hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.ratio
    mixed, z, beta_logit, a = self._project(x)
    history = jnp.zeros((b, self.kernel_size - 1, self.conv_dim), mixed.dtype) if cache is None else cache.conv
    conv = self._conv(mixed, segment_ids, history)
    q, k, v = jnp.split(conv.astype(jnp.float32), [hk * dk, 2 * hk * dk], axis=-1)
    q = jnp.repeat(l2_normalize(q.reshape(b, t, hk, dk)), r, axis=2) * dk**-0.5
    k = jnp.repeat(l2_normalize(k.reshape(b, t, hk, dk)), r, axis=2)
    v = v.reshape(b, t, hv, dv)
    beta = jax.nn.sigmoid(beta_logit.astype(jnp.float32))
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
      a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
    )
    valid = (segment_ids != 0)[..., None]
    previous = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
    not_first = jnp.arange(t)[None, :] > 0
    start = ((segment_ids != previous) & not_first)[..., None] if cache is None else jnp.zeros_like(valid)
    g = jnp.where(valid, jnp.where(start, SEGMENT_START_DECAY, g), 0.0)
    beta = jnp.where(valid, beta, 0.0)
    state = jnp.zeros((b, hv, dk, dv), jnp.float32) if cache is None else cache.ssm
    if t == 1:
      out, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    else:
      out, state = chunked_gated_delta_rule(q, k, v, g, beta, state, self.chunk)
    out = self.norm(out.astype(self.dtype), z)
    out = nn.with_logical_constraint(out, HEAD_AXES)
    if cache is not None:
      # The conv history is each row's last K-1 real inputs (right padding: those before its first pad).
      full = jnp.concatenate([cache.conv.astype(mixed.dtype), mixed], axis=1)
      lengths = jnp.sum(segment_ids != 0, axis=1)  # [B]
      index = lengths[:, None] + jnp.arange(self.kernel_size - 1)[None, :]
      conv_state = jnp.take_along_axis(full, index[..., None], axis=1).astype(cache.conv.dtype)
      cache = RecurrentState(conv_state, state)
    return self.out(out), cache

  def init_cache(self, batch: int, length: int) -> RecurrentState:
    """The empty recurrent state (its size does not depend on `length`)."""
    conv = jnp.zeros((batch, self.kernel_size - 1, self.conv_dim), self.dtype)
    return RecurrentState(conv, jnp.zeros((batch, self.hv, self.dk, self.dv), jnp.float32))

  def forward_flops_per_token(self) -> float:
    """Forward FLOPs per token of the chunked rule and the convolution, projections apart: per value head
    the UT system and intra-chunk scores (2 C Dk each), the triangular solve (C (Dk + Dv)), the intra-chunk
    output (2 C Dv) and the three state matmuls (2 Dk Dv each); the convolution 2 K C."""
    c, dk, dv = self.chunk, self.dk, self.dv
    per_head = 4 * c * dk + c * (dk + dv) + 2 * c * dv + 6 * dk * dv
    return float(self.hv * per_head + 2 * self.kernel_size * self.conv_dim)


class SplitGatedDeltaNet(GatedDeltaNet):
  """The gated DeltaNet with Qwen3.5's separate projections (Hugging Face's layout, so checkpoints convert
  without reordering): in_proj_qkv [D, C] (all q heads, all k heads, all v heads: the convolution's channel
  order), in_proj_z [D, Hv, Dv], in_proj_b and in_proj_a [D, Hv]. The maths is GatedDeltaNet's."""

  def _projections(self, d: int, dense: dict[str, Any]) -> None:
    self.in_proj_qkv = DenseGeneral(d, self.conv_dim, ("embed", "mlp"), **dense)
    self.in_proj_z = DenseGeneral(d, (self.hv, self.dv), ("embed", "q_heads", "kv"), **dense)
    self.in_proj_b = DenseGeneral(d, self.hv, ("embed", "q_heads"), **dense)
    self.in_proj_a = DenseGeneral(d, self.hv, ("embed", "q_heads"), **dense)

  def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)


class GatedAttention(Attention):
  """Softmax attention with Qwen3-Next's output gate and partial RoPE: the query projection yields, per head,
  the query and a gate [N, 2H] (HF's layout); out = o(attention * sigmoid(gate)); RoPE rotates the first
  partial_rotary_factor * H dims of q and k (halves layout within them)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, norm: Callable[..., nnx.Module], **kw: Any):
    super().__init__(config, rngs=rngs, plan=plan, norm=norm, **kw)
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    n, h = config.num_query_heads, config.head_dim
    dense = dict(dtype=dt, weight_dtype=wdt, rngs=rngs, use_bias=config.attention.attention_bias)
    self.query = DenseGeneral(config.emb_dim, (n, 2 * h), ("embed", "q_heads", "kv"), **dense)
    self.rotary_dim = int(h * config.rope.partial_rotary_factor)
    self.qk_head_dim = h  # for flops: the query projection is 2H wide, attention uses H

  def __call__(self, x, positions, segment_ids, rng=None, cache=None):
    h = self.config.head_dim
    q, gate = jnp.split(self.query(x), [h], axis=-1)
    k, v = self.key(x), self.value(x)
    q = nn.with_logical_constraint(q, HEAD_AXES)
    q, k = self.query_norm(q), self.key_norm(k)
    r = self.rotary_dim
    inv_freq = scaled_rope_frequencies(self.config, r, self.rope_max_timescale, self.rope_type)
    scale = rope_attention_factor(self.config, self.rope_type)
    q = jnp.concatenate([apply_rope(q[..., :r], positions, inv_freq, scale), q[..., r:]], axis=-1)
    k = jnp.concatenate([apply_rope(k[..., :r], positions, inv_freq, scale), k[..., r:]], axis=-1)
    q = q * self.query_scale
    if cache is None:
      out = attend(self.plan, q, k, v, segment_ids, self.sliding_window, self.chunk_window)
    else:
      cache = kv_cache.update(cache, k, v, positions)
      keys, values = kv_cache.read(cache, v.dtype)
      mask = kv_cache.mask(positions, cache.key.shape[1], self.sliding_window, self.chunk_window)
      out = dot_product_attention(q, keys, values, mask, self.config.attention.attn_logits_soft_cap)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    out = nn.with_logical_constraint(out, HEAD_AXES)
    return self.out(out), cache
