"""DeepSeek V3.2's lightning indexer: which keys each query of a multi-head latent attention layer attends.

Per layer, index heads h = 1..H score every query t against every key s:
  score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(index_head_dim)),  w = weights_proj(x) / sqrt(H),
with q = wq_b(the MLA query latent) [H, index_head_dim], k = LayerNorm(wk(x)) one key per token (no heads), and
RoPE on the first qk_rope_head_dim dims of both in the halves layout (not interleaved, unlike MLA's rope, so the
checkpoint's indexer weights need no permutation). Scores outside the attention mask (causal, segments) are
-inf; each query keeps its index_topk best keys (ties: the earlier key) and the MLA softmax sees only those.
With no more keys than index_topk the selection is everything the mask allows, so it is skipped.
Training in query blocks (blocked_attention, attention_query_chunk) keeps one block's [B, chunk, S] index scores
and attention scores live at a time, recomputed in the backward pass, instead of the whole [B, T, S].
Decoding caches the indexer keys (kv_cache.LatentCache.index_key) and recomputes the selection over them.
Einsum letters: B, T, S, D as in the legend; H index heads, I index head dim, E q_lora rank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.attention import dot_product_attention, index_mask
from MaxText.layers.embeddings import apply_rope
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import LayerNorm

K_NORM_EPSILON = 1e-6  # fixed in DeepSeek's reference and transformers, not rms_norm_eps


class Indexer(nnx.Module):
  """Scores queries against keys and returns the [B, T, S] bool mask of each query's top index_topk keys."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    d, h, i = config.emb_dim, config.mla.index_n_heads, config.mla.index_head_dim
    dense = dict(dtype=dt, weight_dtype=wdt, rngs=rngs)
    self.wq_b = DenseGeneral(config.mla.q_lora_rank, (h, i), ("q_lora", "q_heads", "kv"), **dense)
    self.wk = DenseGeneral(d, i, ("embed", "kv"), **dense)
    self.k_norm = LayerNorm(i, epsilon=K_NORM_EPSILON, dtype=dt, weight_dtype=wdt)
    self.weights_proj = DenseGeneral(d, h, ("embed", "q_heads"), **dense)
    self.rope_dim, self.topk, self.heads, self.head_dim = config.mla.qk_rope_head_dim, config.mla.index_topk, h, i

  def _rope(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float) -> jax.Array:
    """RoPE on the first rope_dim dims of x [B, T, N, I]; the rest pass through."""
    rot, rest = jnp.split(x, [self.rope_dim], axis=-1)
    return jnp.concatenate([apply_rope(rot, positions, inv_freq, scale), rest], axis=-1)

  def keys(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float) -> jax.Array:
    """x [B, T, D] -> the rotated indexer keys [B, T, I] (what decoding caches)."""
    k = self.k_norm(self.wk(x))[:, :, None]
    return self._rope(k, positions, inv_freq, scale)[:, :, 0]

  def forward_flops_per_token(self, length: int) -> float:
    """Forward FLOPs per token of one training pass over `length` tokens (0 when length <= index_topk: the
    selection is skipped and its unused keys are dead code). The projections wq_b, wk and weights_proj
    (2 per weight), the q.k scores of H heads over all `length` keys (2 H I per key: the full [T, S] matrix
    is computed and masked afterwards, not just its causal half) and their head-weighted sum (2 H per key).
    No backward: the selection (integer top-k indices) passes no gradient to the indexer."""
    if length <= self.topk:
      return 0.0
    projections = sum(math.prod(d.in_features + d.out_features) for d in (self.wq_b, self.wk, self.weights_proj))
    return 2.0 * projections + 2.0 * length * self.heads * (self.head_dim + 1)

  def select(
    self,
    x: jax.Array,
    q_latent: jax.Array,
    keys: jax.Array,
    positions: jax.Array,
    allowed: jax.Array,
    rope: tuple[jax.Array, float],
  ) -> jax.Array:
    """x [B, T, D], the normalised MLA query latent [B, T, E], keys [B, S, I], allowed [B, T, S] ->
    allowed narrowed to each query's index_topk best keys (all of allowed when S <= index_topk)."""
    if keys.shape[1] <= self.topk:
      return allowed
    q = self._rope(self.wq_b(q_latent), positions, *rope)  # [B, T, H, I]
    scores = jnp.einsum("BTHI,BSI->BTHS", q.astype(jnp.float32), keys.astype(jnp.float32))
    scores = jax.nn.relu(scores * self.head_dim**-0.5)
    weights = self.weights_proj(x).astype(jnp.float32) * self.heads**-0.5  # [B, T, H]
    index = jnp.where(allowed, jnp.einsum("BTH,BTHS->BTS", weights, scores), -jnp.inf)
    _, top = jax.lax.top_k(index, self.topk)  # [B, T, topk]; equal scores: the lower index first
    chosen = jnp.put_along_axis(jnp.zeros(index.shape, bool), top, True, axis=-1, inplace=False)
    return allowed & chosen


def blocked_attention(
  indexer: Indexer,
  x: jax.Array,
  q_latent: jax.Array,
  keys: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  qkv: tuple[jax.Array, jax.Array, jax.Array],
  rope: tuple[jax.Array, float],
  cap: float,
  chunk: int,
) -> jax.Array:
  """Training attention (q [B, T, N, H] scaled, k, v [B, T, 1 or N, H]) with the indexer's selection, in
  query blocks of `chunk` (dividing T): per block the causal/segment mask, its top-k narrowing, the attention."""
  q, k, v = qkv
  b, t = q.shape[:2]
  n = t // chunk
  k_index = jnp.arange(t)

  @jax.checkpoint
  def block(args):
    x_c, latent_c, pos_c, seg_c, q_c, index_c = args
    allowed = index_mask(seg_c, segment_ids, index_c, k_index)[:, 0, 0]
    mask = indexer.select(x_c, latent_c, keys, pos_c, allowed, rope)
    return dot_product_attention(q_c, k, v, mask[:, None, None], cap)

  def split(a: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, chunk, ...]
    return a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)

  args = (split(x), split(q_latent), split(positions), split(segment_ids), split(q), k_index.reshape(n, chunk))
  out = jax.lax.map(block, args)
  return out.swapaxes(0, 1).reshape(b, t, *out.shape[3:])
