"""Context parallelism: attention over a sequence split across devices.

The mesh axes that the logical rules give `activation_length` (base.yml: `sequence` and `context`) split
every activation along the sequence; the run plan names them and the shard count (parallel/plan.py).
Position-wise layers need nothing more; attention does: each shard keeps its queries and all-gathers the
keys/values (and their segment ids) along those axes (parallel.ops.context_attention), then attends with
a mask built from the tokens' places in the original sequence. The backward pass of the all-gather is a
reduce-scatter of the key/value gradients. This module holds the single-device part: the layouts and the
mask inputs.

Load balancing. Under a causal mask the last tokens attend to the most keys, so a shard holding a
contiguous tail would do most of the work of a kernel that skips masked blocks, and a shard holding the
head would hold mostly-masked scores. With the sequence cut into 2n chunks for n shards, the balanced
layout gives shard i chunks i and 2n-1-i. The decoder reorders tokens/positions/segment ids into this
layout once at its input and its output back (`balance` / `unbalance`); everything in between is
position-wise except attention, which reads the layout from `original_index`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def chunk_order(shards: int) -> np.ndarray:
  """[2n] chunk ids in balanced order: 0, 2n-1, 1, 2n-2, ..., so shard i's two chunks are i and 2n-1-i."""
  head, tail = np.arange(shards), np.arange(2 * shards - 1, shards - 1, -1)
  return np.stack([head, tail], axis=1).reshape(-1)


def original_index(length: int, shards: int, balanced: bool) -> np.ndarray:
  """[T] int32: the place in the original sequence of the token at each place of the layout."""
  if not balanced:
    return np.arange(length, dtype=np.int32)
  chunk = length // (2 * shards)
  return (chunk_order(shards)[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1).astype(np.int32)


def _reorder(x: jax.Array, order: np.ndarray, axis: int) -> jax.Array:
  parts = order.size
  shape = x.shape
  x = x.reshape(*shape[:axis], parts, shape[axis] // parts, *shape[axis + 1 :])
  return jnp.take(x, jnp.asarray(order), axis=axis).reshape(shape)


def balance(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
  """Original order -> balanced layout along `axis` (its length a multiple of 2 * shards)."""
  return _reorder(x, chunk_order(shards), axis)


def unbalance(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
  """Balanced layout -> original order along `axis`; the inverse of `balance`."""
  return _reorder(x, np.argsort(chunk_order(shards)), axis)


class LocalTokens(NamedTuple):
  """What one shard's attention needs to build its mask: segment ids and original places of its queries
  (t of them) and of all the keys (S = the whole sequence)."""

  q_segments: jax.Array  # [B, t] int
  k_segments: jax.Array  # [B, S] int
  q_index: jax.Array  # [t] int32
  k_index: jax.Array  # [S] int32


# (q [B, t, N, H], k [B, S, K, H], v [B, S, K, Hv], tokens) -> [B, t, N, Hv], on one shard's arrays.
LocalAttention = Callable[[jax.Array, jax.Array, jax.Array, LocalTokens], jax.Array]
