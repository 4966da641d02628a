"""The decode-time key/value cache of one attention layer, and the mask that goes with it.

Slot s of a row holds the key/value of that row's token at position s, so rows of different lengths
decode together: prompts are right-padded, each row writes its next token at its own position, and a
padding slot is overwritten by that row's next token before any query of the row can see it (queries
see slots <= their position). Sliding-window layers keep the full-length cache and mask it.
The decoder stacks one cache per layer with a leading layers axis (scan) or in a list (unrolled).

quantize_kvcache stores keys and values in int8 (or fp8) with one float32 scale per token and kv head
(absmax over the head dim), written once with the token and dequantized when attention reads the cache:
half the bytes of a bfloat16 cache plus 8 bytes per token and kv head for the two scales.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

# Logical axes of cache buffers by rank: [B, S, K, H] (batch over the data axes, kv heads over tensor)
# and [B, S, C] (multi-head latent attention).
CACHE_AXES = {
  4: ("activation_batch", None, "activation_kv_heads", "activation_kv"),
  3: ("activation_batch", None, None),
}


# kv_quant_dtype -> storage dtype of a quantized cache.
QUANT_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


class KVCache(NamedTuple):
  key: jax.Array  # [B, S, K, H], RoPE already applied; in dtype, or a QUANT_DTYPES dtype with key_scale
  value: jax.Array  # [B, S, K, H]
  key_scale: jax.Array | None = None  # [B, S, K] float32 when quantized: key ~= key * key_scale[..., None]
  value_scale: jax.Array | None = None  # [B, S, K] float32 when quantized


class LatentCache(NamedTuple):
  """Multi-head latent attention caches the compressed latent, not the per-head keys and values."""

  latent: jax.Array  # [B, S, C] normalised key/value latent
  rope_key: jax.Array  # [B, S, R] the RoPE key shared by all heads, rotated
  index_key: jax.Array | None = None  # [B, S, I] DeepSeek V3.2's indexer keys, rotated (layers/indexer.py)


def zeros(
  batch: int, length: int, kv_heads: int, head_dim: int, dtype: jnp.dtype, quant_dtype: jnp.dtype | None = None
) -> KVCache:
  """An empty cache in `dtype`, or in `quant_dtype` with float32 scales when given (quantize_kvcache)."""
  shape = (batch, length, kv_heads, head_dim)
  if quant_dtype is None:
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
  scales = jnp.ones(shape[:3], jnp.float32)
  return KVCache(jnp.zeros(shape, quant_dtype), jnp.zeros(shape, quant_dtype), scales, scales)


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
  """x [B, T, K, H] -> (values [B, T, K, H] in `dtype`, scales [B, T, K] float32): symmetric absmax per
  token and head, so one outlier token does not cost the others their resolution."""
  x = x.astype(jnp.float32)
  top = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  scale = jnp.max(jnp.abs(x), axis=-1) / top
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero vector (padding) stays zero
  q = jnp.clip(x / scale[..., None], -top, top)
  return (jnp.round(q) if dtype == jnp.int8 else q).astype(dtype), scale


def write(cache: NamedTuple, new: NamedTuple, positions: jax.Array) -> NamedTuple:
  """Write each buffer's new entries [B, T, ...] into slots `positions` [B, T] of each row."""
  rows = jnp.arange(positions.shape[0])[:, None]

  def one(buffer, values):
    buffer = buffer.at[rows, positions].set(values.astype(buffer.dtype))
    return nn.with_logical_constraint(buffer, CACHE_AXES[buffer.ndim])

  return jax.tree.map(one, cache, new)


def update(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
  """Write k/v [B, T, K, H] into slots `positions` [B, T] of each row (quantized first when the cache is)."""
  if cache.key_scale is None:
    return write(cache, KVCache(k, v), positions)
  (qk, sk), (qv, sv) = quantize(k, cache.key.dtype), quantize(v, cache.value.dtype)
  return write(cache, KVCache(qk, qv, sk, sv), positions)


def read(cache: KVCache, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
  """The cached keys and values [B, S, K, H] for attention: as stored, or dequantized to `dtype`."""
  if cache.key_scale is None:
    return cache.key, cache.value
  key = cache.key.astype(jnp.float32) * cache.key_scale[..., None]
  value = cache.value.astype(jnp.float32) * cache.value_scale[..., None]
  return key.astype(dtype), value.astype(dtype)


def local_window(
  distance: jax.Array, q_index: jax.Array, k_index: jax.Array, sliding_window: int, chunk_window: int
) -> jax.Array:
  """The causal mask `distance >= 0` (distance = q_index - k_index, broadcast) narrowed to the local
  window: i - window < j when sliding_window > 0; the same block of chunk_window places (i // C == j // C,
  llama4's chunked attention) when chunk_window > 0. Shared by the training masks (attention.index_mask)."""
  allowed = distance >= 0
  if sliding_window:
    allowed &= distance < sliding_window
  if chunk_window:
    allowed &= q_index // chunk_window == k_index // chunk_window
  return allowed


def mask(positions: jax.Array, length: int, sliding_window: int = 0, chunk_window: int = 0) -> jax.Array:
  """Queries at `positions` [B, T] over `length` cache slots -> [B, 1, 1, T, S] bool: causal, and local
  (position - window < slot; or the same block of chunk_window slots) when sliding_window or chunk_window > 0."""
  slots = jnp.arange(length)[None, None, :]
  allowed = local_window(positions[:, :, None] - slots, positions[:, :, None], slots, sliding_window, chunk_window)
  return allowed[:, None, None]
