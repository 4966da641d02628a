"""Multi-head latent attention (DeepSeek V2/V3).

Queries: x -> [q_lora_rank] -> RMSNorm -> [N, nope + rope] (or one projection when q_lora_rank = 0).
Keys/values: x -> [kv_lora_rank + rope]; the latent part is normalised and expanded to per-head
[N, nope + v]; the rope part is one RoPE key shared by all heads. Scores use nope and rope dims
together, scaled by (nope + rope) ** -0.5, times yarn_mscale(rope_factor, rope_mscale_all_dim) ** 2 when
RoPE is scaled and rope_mscale_all_dim is set (DeepSeek's YaRN). RoPE is in the halves layout: the
converter de-interleaves DeepSeek's interleaved rope weights (a fixed permutation, so the round trip
stays exact).
Einsum letters: B, T, S, N, D as in the legend; R rope dims, P nope dims, C latent (lora) rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers import kv_cache
from MaxText.layers.attention import attend, attention_mask, dot_product_attention
from MaxText.layers.axes import HEAD_AXES
from MaxText.layers.embeddings import apply_rope, rope_attention_factor, scaled_rope_frequencies, yarn_mscale
from MaxText.layers.indexer import Indexer, blocked_attention
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import RMSNorm

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan


class MLAttention(nnx.Module):
  """x [B, T, D] -> [B, T, D]; same constructor keywords and call contract as Attention."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, plan: Plan, sliding_window: int = 0, norm=RMSNorm, **_):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    d, n = config.emb_dim, config.num_query_heads
    nope, rope, v = config.mla.qk_nope_head_dim, config.mla.qk_rope_head_dim, config.mla.v_head_dim
    dense = dict(dtype=dt, weight_dtype=wdt, rngs=rngs)
    norm_args = dict(epsilon=config.norms.normalization_layer_epsilon, dtype=dt, weight_dtype=wdt)
    self.wq_a = self.q_norm = nnx.data(None)
    if config.mla.q_lora_rank:
      self.wq_a = DenseGeneral(d, config.mla.q_lora_rank, ("embed", "q_lora"), **dense)
      self.q_norm = norm(config.mla.q_lora_rank, **norm_args)
      self.wq_b = DenseGeneral(config.mla.q_lora_rank, (n, nope + rope), ("q_lora", "q_heads", "kv"), **dense)
    else:
      self.query = DenseGeneral(d, (n, nope + rope), ("embed", "q_heads", "kv"), **dense)
    self.wkv_a = DenseGeneral(d, config.mla.kv_lora_rank + rope, ("embed", "kv_lora"), **dense)
    self.kv_norm = norm(config.mla.kv_lora_rank, **norm_args)
    self.wkv_b = DenseGeneral(config.mla.kv_lora_rank, (n, nope + v), ("kv_lora", "kv_heads", "kv"), **dense)
    self.out = DenseGeneral((n, v), d, ("heads", "kv", "embed"), **dense)
    # DeepSeek V3.2's lightning indexer (layers/indexer.py): each query attends its index_topk best keys only.
    self.indexer = Indexer(config, rngs=rngs) if config.mla.index_n_heads else nnx.data(None)
    self.config, self.plan, self.sliding_window = config, plan, sliding_window
    self.dims = (nope, rope, v)
    self.query_scale = (nope + rope) ** -0.5
    if config.rope.rope_type != "default" and config.rope.rope_mscale_all_dim:  # as transformers' DeepSeek V2/V3
      self.query_scale *= yarn_mscale(config.rope.rope_factor, config.rope.rope_mscale_all_dim) ** 2

  def _queries(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """x -> (queries [B, T, N, P + R], the normalised query latent [B, T, E] or None without q_lora_rank)."""
    if self.wq_a is None:
      return self.query(x), None
    q_latent = self.q_norm(self.wq_a(x))
    return self.wq_b(q_latent), q_latent

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    rng: jax.Array | None = None,  # the layer contract's; attention has no dropout of its own
    cache: kv_cache.LatentCache | None = None,
  ) -> tuple[jax.Array, kv_cache.LatentCache | None]:
    """x [B, T, D] -> (out [B, T, D], cache); cache is None in training. With a decode `cache` (the
    normalised latent and the rotated RoPE key of every position), attends over it and returns it updated."""
    nope, rope, _ = self.dims
    c = self.config
    q, q_latent = self._queries(x)
    q = checkpoint_name(q, "query_proj")
    q = nn.with_logical_constraint(q, HEAD_AXES)
    latent, k_rope = jnp.split(self.wkv_a(x), [c.mla.kv_lora_rank], axis=-1)  # [B, T, C], [B, T, R]
    latent = self.kv_norm(latent)
    inv_freq = scaled_rope_frequencies(c, rope, c.rope.rope_max_timescale, c.rope.rope_type)
    rope_scale = rope_attention_factor(c, c.rope.rope_type)
    k_rope = apply_rope(k_rope[:, :, None, :], positions, inv_freq, rope_scale)  # one shared head
    index_keys = None if self.indexer is None else self.indexer.keys(x, positions, inv_freq, rope_scale)
    if cache is None:
      mask = None
    else:
      cache = kv_cache.write(cache, kv_cache.LatentCache(latent, k_rope[:, :, 0], index_keys), positions)
      latent, k_rope, index_keys = cache
      k_rope = k_rope[:, :, None]
      mask = kv_cache.mask(positions, latent.shape[1], self.sliding_window)
    chunk = self.plan.attention.query_chunk
    blocked = self.indexer is not None and mask is None and 0 < chunk < x.shape[1] and x.shape[1] % chunk == 0
    if self.indexer is not None and not blocked:  # the top-k selection narrows the mask
      if mask is None:
        mask = attention_mask(segment_ids, self.sliding_window)
      mask = self.indexer.select(x, q_latent, index_keys, positions, mask[:, 0, 0], (inv_freq, rope_scale))
      mask = mask[:, None, None]
    kv = checkpoint_name(self.wkv_b(latent), "key_proj")  # [B, S, N, P + V]
    k_nope, v = jnp.split(kv, [nope], axis=-1)
    q_nope, q_rope = jnp.split(q, [nope], axis=-1)
    q_rope = apply_rope(q_rope, positions, inv_freq, rope_scale)
    q = jnp.concatenate([q_nope, q_rope], axis=-1) * self.query_scale
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], rope))], axis=-1)
    if blocked:
      rope_args, cap = (inv_freq, rope_scale), c.attention.attn_logits_soft_cap
      out = blocked_attention(
        self.indexer, x, q_latent, index_keys, positions, segment_ids, (q, k, v), rope_args, cap, chunk
      )
    elif mask is None:
      out = attend(self.plan, q, k, v, segment_ids, self.sliding_window)
    else:
      out = dot_product_attention(q, k, v, mask, c.attention.attn_logits_soft_cap)
    out = checkpoint_name(nn.with_logical_constraint(out, HEAD_AXES), "context")
    return checkpoint_name(self.out(out), "out_proj"), cache

  def init_cache(self, batch: int, length: int) -> kv_cache.LatentCache:
    c, dtype = self.config, jnp.dtype(self.config.dtype)
    if self.plan.kv_cache_quant:  # users get inference/quantize.check's ConfigError before any device work
      raise ValueError("quantize_kvcache=true is not supported with MLA (deepseek)")
    index_keys = jnp.zeros((batch, length, c.mla.index_head_dim), dtype) if self.indexer is not None else None
    return kv_cache.LatentCache(
      jnp.zeros((batch, length, c.mla.kv_lora_rank), dtype),
      jnp.zeros((batch, length, c.mla.qk_rope_head_dim), dtype),
      index_keys,
    )
