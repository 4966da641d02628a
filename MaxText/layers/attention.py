"""Grouped-query self-attention (attention=dot_product) with packing-aware causal masks."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.config import Config
from MaxText.layers.embeddings import apply_rope, rope_frequencies
from MaxText.layers.linears import DenseGeneral

# Large finite negative instead of -inf: a fully masked row (padding) then gives a uniform softmax,
# not NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids -> [B, 1, 1, T, S] bool: causal and within the same document."""
  t = segment_ids.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_doc)[:, None, None]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """q [B, T, N, H], k/v [B, S, K, H], mask [B, 1, 1, T, S] -> [B, T, N, H]; softmax in float32."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, h)  # [B, T, K, G, H]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask, scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
  return out.reshape(b, t, n, h)


class Attention(nnx.Module):
  """Projections q/k/v/o, RoPE, and GQA attention over a packed batch."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    d, n, k, h = config.emb_dim, config.num_query_heads, config.num_kv_heads, config.head_dim
    dense = dict(dtype=dt, weight_dtype=wdt, rngs=rngs)
    self.query = DenseGeneral(d, (n, h), ("embed", "q_heads", "kv"), **dense)
    self.key = DenseGeneral(d, (k, h), ("embed", "kv_heads", "kv"), **dense)
    self.value = DenseGeneral(d, (k, h), ("embed", "kv_heads", "kv"), **dense)
    self.out = DenseGeneral((n, h), d, ("heads", "kv", "embed"), **dense)
    self.rope_timescales = (config.rope_min_timescale, config.rope_max_timescale)
    self.head_dim = h

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """x [B, T, D], positions/segment_ids [B, T] -> [B, T, D]."""
    q = checkpoint_name(self.query(x), "query_proj")
    k = checkpoint_name(self.key(x), "key_proj")
    v = checkpoint_name(self.value(x), "value_proj")
    q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
    k = nn.with_logical_constraint(k, ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv"))
    inv_freq = rope_frequencies(self.head_dim, *self.rope_timescales)
    q = apply_rope(q, positions, inv_freq) * (self.head_dim**-0.5)
    k = apply_rope(k, positions, inv_freq)
    out = dot_product_attention(q, k, v, attention_mask(segment_ids))
    out = nn.with_logical_constraint(
      out, ("activation_batch", "activation_length", "activation_heads", "activation_kv")
    )
    return checkpoint_name(self.out(out), "out_proj")
