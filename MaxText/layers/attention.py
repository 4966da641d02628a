"""Grouped-query self-attention (attention=dot_product) with packing-aware causal masks.

Options, all from the config or the family's layer: sliding-window (local) attention, attention-logit
soft-capping, a query scale other than head_dim**-0.5, per-head q/k norms, a per-layer RoPE base,
projection biases.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import context_parallel, kv_cache
from MaxText.layers.attention_kernels import flash_attention
from MaxText.layers.axes import HEAD_AXES, KV_HEAD_AXES
from MaxText.layers.embeddings import apply_rope, rope_attention_factor, scaled_rope_frequencies
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import HeadsRMSNorm, RMSNorm
from MaxText.parallel import ops

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

# Large finite negative instead of -inf: a fully masked row (padding) then gives a uniform softmax,
# not NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def index_mask(
  q_segments: jax.Array, k_segments: jax.Array, q_index: jax.Array, k_index: jax.Array, sliding_window: int = 0,
  chunk_window: int = 0,
) -> jax.Array:  # fmt: skip
  """Queries' segment ids [B, T] and places in the sequence [T], keys' [B, S] and [S] -> [B, 1, 1, T, S]
  bool: causal by place, within the same document, and local (local_window) when sliding_window or
  chunk_window > 0. Places, not array positions, so a reordered or split sequence (context parallelism)
  masks as the original one; chunks count from the row's first place, not each packed document's."""
  distance = q_index[:, None] - k_index[None, :]  # i - j
  allowed = kv_cache.local_window(distance, q_index[:, None], k_index[None, :], sliding_window, chunk_window)
  same_doc = q_segments[:, :, None] == k_segments[:, None, :]
  return (allowed[None] & same_doc)[:, None, None]


def attention_mask(
  segment_ids: jax.Array, sliding_window: int = 0, query_start: jax.Array | int = 0, query_length: int | None = None,
  chunk_window: int = 0,
) -> jax.Array:  # fmt: skip
  """[B, S] segment ids -> [B, 1, 1, T, S] bool for the T = query_length (default S) queries from
  position query_start: index_mask over the sequence in its original order."""
  s = segment_ids.shape[1]
  t = s if query_length is None else query_length
  query_ids = segment_ids if t == s else jax.lax.dynamic_slice_in_dim(segment_ids, query_start, t, axis=1)
  return index_mask(query_ids, segment_ids, query_start + jnp.arange(t), jnp.arange(s), sliding_window, chunk_window)


class ImageSegments(NamedTuple):
  """segment_ids [B, T] with image blocks [B, T] (vision.image_blocks: the image's index on its placeholder
  tokens, -1 on text), passed where segment_ids go when a row holds images: keys of a query's own image
  block are visible both ways; the rest stays causal (and local in sliding-window layers)."""

  ids: jax.Array
  blocks: jax.Array


def block_mask(
  q_blocks: jax.Array, k_blocks: jax.Array, q_index: jax.Array, k_index: jax.Array, sliding_window: int
) -> jax.Array:  # fmt: skip
  """Queries' image blocks [B, T] at places [B or 1, T], keys' [B, S] at [S] -> [B, 1, 1, T, S] bool: the
  same image (and within the window when sliding_window > 0; HF: AND(window, OR(causal, blockwise)))."""
  same = (q_blocks[:, :, None] == k_blocks[:, None, :]) & (q_blocks[:, :, None] >= 0)
  if sliding_window:
    same &= q_index[..., :, None] - k_index[None, None, :] < sliding_window
  return same[:, None, None]


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap); identity when cap is 0."""
  return x if not cap else cap * jnp.tanh(x / cap)


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
  """scores [B, K, G, T, S] float32, sinks [K * G] -> probabilities [B, K, G, T, S]: each row's softmax with
  its head's sink logit as one more key (no value), so a row sums to less than 1 (gpt-oss)."""
  sink = sinks.astype(jnp.float32).reshape(1, scores.shape[1], scores.shape[2], 1, 1)
  top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
  weights = jnp.exp(scores - top)
  return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top))


def dot_product_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, logits_soft_cap: float = 0.0,
  sinks: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
  """q [B, T, N, H] (already scaled), k/v [B, S, K, H], mask [B, 1, 1, T, S] -> [B, T, N, H];
  softmax in float32, over the keys and, when given, the heads' sink logits `sinks` [N]."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)  # [B, T, K, G, H]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask, soft_cap(scores, logits_soft_cap), MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1) if sinks is None else softmax_with_sinks(scores, sinks)
  probs = probs.astype(v.dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
  return out.reshape(b, t, n, v.shape[-1])


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """attention=cudnn_flash_te: cuDNN's fused (flash) attention through jax.nn.dot_product_attention.
  Same contract as dot_product_attention, without a soft cap; q already scaled. NVIDIA GPUs only (the
  run plan checks both)."""
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, 0], scale=1.0, implementation="cudnn")


def whole_sequence(segment_ids: jax.Array) -> context_parallel.LocalTokens:
  """The mask inputs of an unsplit sequence in its original order: queries and keys are all tokens."""
  index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  return context_parallel.LocalTokens(segment_ids, segment_ids, index, index)


def chunked_dot_product_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, sliding_window: int,
  logits_soft_cap: float, chunk: int, tokens: context_parallel.LocalTokens | None = None, chunk_window: int = 0,
  sinks: jax.Array | None = None, blocks: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
  """dot_product_attention over query blocks of `chunk` tokens, each rematerialised in the backward pass:
  the [B, N, chunk, S] scores of one block are live at a time instead of the whole [B, N, T, S].
  `tokens` (default: whole_sequence(segment_ids)) places the T queries and S keys for the mask; `blocks`
  [B, T] (ImageSegments.blocks, whole sequence only) also opens each image block to its own tokens both ways."""
  tokens = whole_sequence(segment_ids) if tokens is None else tokens
  b, t = q.shape[:2]
  n = t // chunk

  @jax.checkpoint
  def block(q_block, q_segments, q_index, q_images):
    mask = index_mask(q_segments, tokens.k_segments, q_index, tokens.k_index, sliding_window, chunk_window)
    if blocks is not None:
      same_doc = (q_segments[:, :, None] == tokens.k_segments[:, None, :])[:, None, None]
      mask |= block_mask(q_images, blocks, q_index, tokens.k_index, sliding_window) & same_doc
    return dot_product_attention(q_block, k, v, mask, logits_soft_cap, sinks)

  def split(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, chunk, ...]
    return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

  images = split(blocks) if blocks is not None else jnp.zeros((n, 0), jnp.int32)  # placeholder when text only
  args = (split(q), split(tokens.q_segments), tokens.q_index.reshape(n, chunk), images)
  out = jax.lax.map(lambda a: block(*a), args)
  return out.swapaxes(0, 1).reshape(b, t, *out.shape[3:])


def local_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, tokens: context_parallel.LocalTokens, *, sliding_window: int,
  logits_soft_cap: float, chunk: int, chunk_window: int = 0,
) -> jax.Array:  # fmt: skip
  """dot_product attention of one context shard's queries over all keys (context_parallel.LocalAttention),
  in query blocks of `chunk` when chunk divides the local length."""
  t = q.shape[1]
  if 0 < chunk < t and t % chunk == 0:
    return chunked_dot_product_attention(q, k, v, None, sliding_window, logits_soft_cap, chunk, tokens, chunk_window)
  mask = index_mask(tokens.q_segments, tokens.k_segments, tokens.q_index, tokens.k_index, sliding_window, chunk_window)
  return dot_product_attention(q, k, v, mask, logits_soft_cap)


def attend(
  plan: Plan, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, sliding_window: int = 0,
  chunk_window: int = 0, sinks: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
  """Attention without a decode cache (training, evaluation) through the plan's kernel: q [B, T, N, Hq]
  already scaled, k [B, T, K, Hq], v [B, T, K, Hv] -> [B, T, N, Hv]; causal, within segments, local when
  sliding_window or chunk_window > 0 (local_window).

  Under context parallelism (plan.attention.context_shards > 1) the arrays come split along T and, when
  load_balanced, in the balanced layout the decoder made; attention then runs per shard. `sinks` [N]
  (attention_sink): dot_product on the whole sequence only, which the plan ensures."""
  run = plan.attention
  cap, t = run.soft_cap, q.shape[1]
  kind = run.kernel_for(t)
  if kind == "flash":
    pad = q.shape[-1] - v.shape[-1]  # MLA: values narrower than queries/keys; zero columns cost little
    v_full = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad))) if pad > 0 else v
    out = flash_attention(
      q, k, v_full, segment_ids, sliding_window=sliding_window, logits_soft_cap=cap, interpret=run.interpret,
      chunk_window=chunk_window, plan=plan,
    )  # fmt: skip
    return out[..., : v.shape[-1]]
  if kind == "cudnn_flash_te":
    return cudnn_attention(q, k, v, attention_mask(segment_ids, sliding_window, chunk_window=chunk_window))
  chunk = run.query_chunk
  if run.context_shards > 1:
    local = functools.partial(
      local_attention, sliding_window=sliding_window, logits_soft_cap=cap, chunk=chunk, chunk_window=chunk_window
    )
    index = context_parallel.original_index(t, run.context_shards, run.load_balanced)
    return ops.context_attention(plan, local, index, q, k, v, segment_ids, context_parallel.LocalTokens)
  if 0 < chunk < t and t % chunk == 0:
    return chunked_dot_product_attention(
      q, k, v, segment_ids, sliding_window, cap, chunk, chunk_window=chunk_window, sinks=sinks
    )
  mask = attention_mask(segment_ids, sliding_window, chunk_window=chunk_window)
  return dot_product_attention(q, k, v, mask, cap, sinks)


def temperature_scale(positions: jax.Array, config: ModelConfig) -> jax.Array:
  """positions [B, T] -> float32 query multipliers [B, T]: 1 + scale * ln(1 + floor((position + 1) / floor_scale))
  (temperature_tuning_*), which sharpens attention far into a long context where no RoPE tells distance."""
  steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / config.attention.temperature_tuning_floor_scale)
  return 1.0 + config.attention.temperature_tuning_scale * jnp.log1p(steps)


class Attention(nnx.Module):
  """Projections q/k/v/o, optional q/k norms, RoPE, and GQA attention over a packed batch.

  `plan`: the run plan (parallel/plan.py), whose attention decisions training attention follows.
  `sliding_window` (0: global), `chunk_window` (None: config.attention.chunk_attn_window_size; 0: none) and
  `rope_max_timescale` (None: config.rope.rope_max_timescale) let a family make local and global layers;
  `norm` builds the q/k norms (Gemma's 1+w or plain RMSNorm), `qk_norm` overrides it for them alone
  (llama4's weightless norm) and `use_qk_norm` (None: config.attention.use_qk_norm) turns them on per layer. Biases
  on q/k/v/o come from config.attention.attention_bias or `use_bias` (gpt3, which also has no RoPE: `use_rope`);
  `out_bias=False` leaves o without one (glm4_moe). RoPE rotates only the first
  config.rope.partial_rotary_factor of each head's dims (halves layout within them; glm4_moe, minimax_m2).
  Layers without RoPE scale their queries by position when config.attention.temperature_tuning (llama4's NoPE layers).
  config.attention.attention_sink adds `sinks` [N], one learned softmax logit per query head (gpt-oss).
  """

  def __init__(
    self,
    config: ModelConfig,
    *,
    rngs: nnx.Rngs,
    plan: Plan,
    sliding_window: int = 0,
    rope_max_timescale: float | None = None,
    rope_type: str | None = None,
    norm: Callable[..., nnx.Module] = RMSNorm,
    use_bias: bool = False,
    use_rope: bool = True,
    chunk_window: int | None = None,
    use_qk_norm: bool | None = None,
    qk_norm: Callable[..., nnx.Module] | None = None,
    out_bias: bool | None = None,
  ):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    d, n, k, h = config.emb_dim, config.num_query_heads, config.num_kv_heads, config.head_dim
    dense = dict(dtype=dt, weight_dtype=wdt, rngs=rngs, use_bias=use_bias or config.attention.attention_bias)
    self.query = DenseGeneral(d, (n, h), ("embed", "q_heads", "kv"), **dense)
    self.key = DenseGeneral(d, (k, h), ("embed", "kv_heads", "kv"), **dense)
    self.value = DenseGeneral(d, (k, h), ("embed", "kv_heads", "kv"), **dense)
    out_dense = dense if out_bias is None else dense | {"use_bias": out_bias}
    self.out = DenseGeneral((n, h), d, ("heads", "kv", "embed"), **out_dense)
    self.rotary_dim = int(h * config.rope.partial_rotary_factor)  # partial RoPE below 1 (glm4_moe, minimax_m2)
    self.query_norm = self.key_norm = nnx.data(None)
    if config.attention.use_qk_norm if use_qk_norm is None else use_qk_norm:
      norm_args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=dt, weight_dtype=wdt)
      qk_norm = norm if qk_norm is None else qk_norm
      self.query_norm, self.key_norm = qk_norm(h, **norm_args), qk_norm(h, **norm_args)
    self.config, self.plan = config, plan
    self.sliding_window = sliding_window
    self.chunk_window = config.attention.chunk_attn_window_size if chunk_window is None else chunk_window
    self.temperature_tuning = config.attention.temperature_tuning and not use_rope
    self.rope_max_timescale = config.rope.rope_max_timescale if rope_max_timescale is None else rope_max_timescale
    self.rope_type = config.rope.rope_type if rope_type is None else rope_type
    self.query_scale = (config.attention.query_pre_attn_scalar or h) ** -0.5
    self.use_rope = use_rope
    self.sinks = nnx.data(None)
    if config.attention.attention_sink:
      self.sinks = nnx.Param(jnp.zeros((n,), wdt), out_sharding=("heads",))

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    rng: jax.Array | None = None,  # the layer contract's; attention has no dropout of its own
    cache: kv_cache.KVCache | None = None,
  ) -> tuple[jax.Array, kv_cache.KVCache | None]:
    """x [B, T, D], positions/segment_ids [B, T] -> (out [B, T, D], cache); cache is None in training.

    Decoding: with a `cache`, k/v are written into it at `positions` and the queries attend over the
    whole cache (layers/kv_cache.py); the updated cache is returned.
    """
    q, k, v, cache = self.queries_keys_values(x, positions, cache)
    return self.attend(q, k, v, positions, segment_ids, cache is not None), cache

  def queries_keys_values(
    self, x: jax.Array, positions: jax.Array, cache: kv_cache.KVCache | None = None
  ) -> tuple[jax.Array, jax.Array, jax.Array, kv_cache.KVCache | None]:
    """project's q, k, v and the cache; decoding, k/v go into the cache and its whole keys/values come back."""
    q, k, v = self.project(x, positions)
    if cache is not None:
      cache = kv_cache.update(cache, k, v, positions)
      k, v = kv_cache.read(cache, v.dtype)
    return q, k, v, cache

  def attend(
    self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segment_ids: jax.Array,
    decoding: bool = False,
  ) -> jax.Array:  # fmt: skip
    """q [B, T, N, H] over k/v [B, S, K, H] -> out [B, T, D] (after the o projection). `decoding`: k/v are a
    whole decode cache's (queries at `positions`), else the same tokens' as q (the plan's kernel)."""
    sinks = None if self.sinks is None else self.sinks[...]
    blocks = None
    if isinstance(segment_ids, ImageSegments):
      segment_ids, blocks = segment_ids
    if not decoding and blocks is None:
      out = attend(self.plan, q, k, v, segment_ids, self.sliding_window, self.chunk_window, sinks)
    elif not decoding and (chunk := self.plan.attention.image_chunk_for(q.shape[1])):
      # images: their bidirectional blocks over the causal mask, dot-product attention in query blocks (the plan's)
      cap, window = self.config.attention.attn_logits_soft_cap, self.sliding_window
      out = chunked_dot_product_attention(
        q, k, v, segment_ids, window, cap, chunk, chunk_window=self.chunk_window, sinks=sinks, blocks=blocks
      )
    elif not decoding:  # the same over the whole sequence at once
      mask = attention_mask(segment_ids, self.sliding_window, chunk_window=self.chunk_window)
      index = jnp.arange(segment_ids.shape[1])
      same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
      mask |= block_mask(blocks, blocks, index, index, self.sliding_window) & same_doc
      out = dot_product_attention(q, k, v, mask, self.config.attention.attn_logits_soft_cap, sinks)
    else:
      mask = kv_cache.mask(positions, k.shape[1], self.sliding_window, self.chunk_window)
      if blocks is not None:  # a prefill with images: its tokens sit in cache slots 0..T-1
        k_blocks = jnp.pad(blocks, ((0, 0), (0, k.shape[1] - blocks.shape[1])), constant_values=-1)
        mask |= block_mask(blocks, k_blocks, positions, jnp.arange(k.shape[1]), self.sliding_window)
      out = dot_product_attention(q, k, v, mask, self.config.attention.attn_logits_soft_cap, sinks)
    out = checkpoint_name(nn.with_logical_constraint(out, HEAD_AXES), "context")
    return checkpoint_name(self.out(out), "out_proj")

  def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> q [B, T, N, H] (normed, rotated, scaled), k [B, T, K, H] (normed, rotated), v [B, T, K, H]."""
    q = checkpoint_name(self.query(x), "query_proj")
    k = checkpoint_name(self.key(x), "key_proj")
    v = checkpoint_name(self.value(x), "value_proj")
    q = nn.with_logical_constraint(q, HEAD_AXES)
    k = nn.with_logical_constraint(k, KV_HEAD_AXES)
    if self.query_norm is not None:
      q, k = self.query_norm(q), self.key_norm(k)
    if self.use_rope:
      q, k = self.rope(q, positions), self.rope(k, positions)
    q = q * self.query_scale
    if self.temperature_tuning:
      q = q * temperature_scale(positions, self.config)[:, :, None, None].astype(q.dtype)
    return q, k, v

  def rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE over the first rotary_dim dims of each head of x [B, T, N, H] (all of them at partial_rotary_factor 1)."""
    r = self.rotary_dim
    inv_freq = scaled_rope_frequencies(self.config, r, self.rope_max_timescale, self.rope_type)
    scale = rope_attention_factor(self.config, self.rope_type)
    if r == x.shape[-1]:
      return apply_rope(x, positions, inv_freq, scale)
    return jnp.concatenate([apply_rope(x[..., :r], positions, inv_freq, scale), x[..., r:]], axis=-1)

  def init_cache(self, batch: int, length: int) -> kv_cache.KVCache:
    """An empty decode cache of `length` slots (int8/fp8 with scales under quantize_kvcache)."""
    c = self.config
    quant = kv_cache.QUANT_DTYPES[self.plan.kv_cache_quant] if self.plan.kv_cache_quant else None
    return kv_cache.zeros(batch, length, c.num_kv_heads, c.head_dim, jnp.dtype(c.dtype), quant)


class HeadsNormAttention(Attention):
  """The shared attention whose q/k norms (use_qk_norm) run over each token's whole projected query and key, all
  heads together (HeadsRMSNorm; olmo3, minimax_m2), instead of per head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, **kwargs):
    super().__init__(config, rngs=rngs, plan=plan, **{**kwargs, "use_qk_norm": False})
    if config.attention.use_qk_norm:
      args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=jnp.dtype(config.dtype))
      args["weight_dtype"] = jnp.dtype(config.weight_dtype)
      self.query_norm = HeadsRMSNorm(config.num_query_heads, config.head_dim, **args)
      self.key_norm = HeadsRMSNorm(config.num_kv_heads, config.head_dim, **args)
