"""Context parallelism: attention over a sequence split across devices.

The mesh axes that the logical rules give `activation_length` (base.yml: `sequence` and `context`) split
every activation along the sequence. Position-wise layers need nothing more; attention does: each shard
keeps its queries and all-gathers the keys/values (and their segment ids) along those axes inside a
`jax.shard_map`, then attends with a mask built from the tokens' places in the original sequence. The
backward pass of the all-gather is a reduce-scatter of the key/value gradients.

Load balancing. Under a causal mask the last tokens attend to the most keys, so a shard holding a
contiguous tail would do most of the work of a kernel that skips masked blocks, and a shard holding the
head would hold mostly-masked scores. With the sequence cut into 2n chunks for n shards, the balanced
layout gives shard i chunks i and 2n-1-i. The decoder reorders tokens/positions/segment ids into this
layout once at its input and its output back (`balance` / `unbalance`); everything in between is
position-wise except attention, which reads the layout from `original_index`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from MaxText.layers.attention_kernels import shard_plan
from MaxText.layers.axes import HEAD_AXES, axes_size, mesh_axes


def length_axes(mesh: jax.sharding.AbstractMesh | None = None) -> tuple[str, ...]:
  """The mesh axes (size > 1) splitting activation_length under the active rules; () without a mesh."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return () if mesh.empty else mesh_axes("activation_length", HEAD_AXES, mesh)


def num_shards(mesh: jax.sharding.AbstractMesh | None = None) -> int:
  """How many pieces the sequence is split into (1: no context parallelism)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return axes_size(length_axes(mesh), mesh) if not mesh.empty else 1


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


def _specs(q_shape, k_shape, mesh, axes) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec, bool]:
  """shard_map specs of q (and the output), k/v and segment ids: batch and heads as the flash kernel
  splits them (attention_kernels.shard_plan), the sequence over the context axes."""
  plan = shard_plan(q_shape, k_shape, mesh)
  seq = axes if len(axes) > 1 else axes[0]
  q = PartitionSpec(plan.q[0], seq, plan.q[2], None)
  kv = PartitionSpec(plan.kv[0], seq, plan.kv[2], None)
  return q, kv, PartitionSpec(plan.segment_ids[0], seq), plan.repeat_kv


def attention(
  local: LocalAttention, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, balanced: bool
) -> jax.Array:
  """Context-parallel attention under the active mesh: q [B, T, N, H], k [B, T, K, H], v [B, T, K, Hv],
  segment_ids [B, T], all in the layout the decoder chose (balanced or original order) -> [B, T, N, Hv].
  `local` attends one shard's queries over the gathered keys. T must be a multiple of the shards (2x the
  shards when balanced); the caller checks."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = length_axes(mesh)
  shards, length = axes_size(axes, mesh), q.shape[1]
  index = original_index(length, shards, balanced)
  q_spec, kv_spec, seg_spec, repeat_kv = _specs(q.shape, k.shape, mesh, axes)
  if repeat_kv:
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=1, tiled=True)

  def body(q, k, v, segments):
    t = q.shape[1]
    start = jax.lax.axis_index(axes) * t
    k_index = jnp.asarray(index)
    tokens = LocalTokens(segments, gather(segments), jax.lax.dynamic_slice_in_dim(k_index, start, t), k_index)
    return local(q, gather(k), gather(v), tokens)

  return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec)(
    q, k, v, segment_ids
  )
