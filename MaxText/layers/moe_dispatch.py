"""Expert parallelism: routed tokens move to the experts' shards, the experts' weights stay split over the
`expert` mesh axes.

Each function here runs per shard (inside the shard_map of `MoeBlock`, or on one device with `ep_axes=()`):
the shard holds its own tokens and E_l = E / ep experts. Its assignments are sorted by expert, which
also sorts them by destination shard (shard s owns experts [s * E_l, (s + 1) * E_l)), sent there with one
all-to-all over `ep_axes`, run through the local experts and sent back with a second one. No step gathers
the batch's routed tokens onto every shard.

Dropless: each source gives each destination a block of `x * min(k, E_l)` rows, the most it can send
there (a token picks an expert once). On TPU and GPU the rows go packed with jax.lax.ragged_all_to_all
into those blocks; XLA:CPU has no ragged all-to-all, so on CPU the blocks are padded and move with a
dense all_to_all (same layout, same results, ep times the bytes). The receiver sorts its rows by local
expert (padding rows carry the id E_l and sort last) for jax.lax.ragged_dot.

Capacity: `groups` groups of consecutive tokens per shard (one per sequence, or one per shard) each give
every expert C = ceil(capacity_factor * group tokens * k / E) slots, filled in token order; the [E, G*C, D]
buffer moves with a dense all_to_all, as its size is static.
Einsum letters as in moe.py; S slots one source sends one expert (G*C), P ep shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


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


class Layout(NamedTuple):
  """Where each of a shard's A = X*k assignments goes, in expert-sorted order."""

  order: jax.Array  # [A] assignment index of each sorted position
  dest: jax.Array  # [A] destination shard of each sorted position
  pos: jax.Array  # [A] row within its destination's block
  counts: jax.Array  # [P] assignments sent to each shard
  starts: jax.Array  # [P] first sorted position of each destination's run


def grouped_mlp(rows: jax.Array, sizes: jax.Array, wi_0, wi_1, wo, glu: Callable, *biases) -> jax.Array:
  """rows [M, D] grouped by expert (group e has sizes[e] rows; rows past sum(sizes) give 0), weights
  [E, D, F] / [E, F, D] -> [M, D]: each row through its expert's gated MLP, glu(gate, up) -> hidden; with
  `biases` (wi_0's and wi_1's, [E, F]) each row's expert adds its own to the gate and up projections."""
  gate, up = jax.lax.ragged_dot(rows, wi_0, sizes), jax.lax.ragged_dot(rows, wi_1, sizes)
  if biases:
    # The expert of each row: the first group whose end lies beyond it (rows past the groups: none, bias 0).
    ids = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows.shape[0]), side="right")
    b0, b1 = (jnp.take(b, ids, axis=0, mode="fill", fill_value=0).astype(gate.dtype) for b in biases)
    gate, up = gate + b0, up + b1
  return jax.lax.ragged_dot(glu(gate, up), wo, sizes)


def expert_hidden(buffer: jax.Array, wi_0, wi_1, glu: Callable, *biases) -> jax.Array:
  """buffer [E, C, D] -> hidden [E, C, F] = glu(gate, up) of each expert's slots (biases [E, F] added)."""
  gate, up = jnp.einsum("ECD,EDF->ECF", buffer, wi_0), jnp.einsum("ECD,EDF->ECF", buffer, wi_1)
  if biases:
    gate, up = gate + biases[0][:, None].astype(gate.dtype), up + biases[1][:, None].astype(up.dtype)
  return glu(gate, up)


def inverse(perm: jax.Array) -> jax.Array:
  """The inverse of a permutation [N], by a scatter of int32 indices: rows are then put back in place by a
  gather (jnp.take), not by a scatter of the [N, D] rows, which XLA:TPU lowers with u32 and mask copies of
  the whole array (0.5 GiB each for mixtral's [32768, 4096] rows, benchmarks/README.md)."""
  return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def layout(experts: jax.Array, local_experts: int, ep: int) -> Layout:
  """experts [X, k] -> the expert-sorted Layout of the assignments over `ep` shards of `local_experts`."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  dest = flat[order] // local_experts
  counts = jnp.bincount(flat // local_experts, length=ep).astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  return Layout(order, dest, jnp.arange(flat.shape[0]) - starts[dest], counts, starts)


def all_to_all(x: jax.Array, ep_axes: tuple[str, ...]) -> jax.Array:
  """[P, ...] -> [P, ...]: block p goes to shard p; block q of the result came from shard q."""
  return jax.lax.all_to_all(x, ep_axes, 0, 0, tiled=True) if ep_axes else x


def _send_dense(rows, ids, lay: Layout, block: int, ep_axes, fill: int):
  """Padded blocks: [A, D] rows and [A] ids -> received [P * block, D] and [P * block] (CPU)."""
  ep = lay.counts.shape[0]
  send = jnp.zeros((ep, block, rows.shape[-1]), rows.dtype).at[lay.dest, lay.pos].set(rows)
  send_ids = jnp.full((ep, block), fill, jnp.int32).at[lay.dest, lay.pos].set(ids)
  recv, recv_ids = all_to_all(send, ep_axes), all_to_all(send_ids, ep_axes)
  return recv.reshape(ep * block, -1), recv_ids.reshape(-1)


def _return_dense(out, lay: Layout, block: int, ep_axes):
  back = all_to_all(out.reshape(lay.counts.shape[0], block, -1), ep_axes)
  return back[lay.dest, lay.pos]  # [A, D], expert-sorted order


def _ragged_offsets(lay: Layout, block: int, ep_axes):
  """Source i's rows land at i * block in every receiver; recv[j]: rows shard j sends here."""
  ep = lay.counts.shape[0]
  me = jax.lax.axis_index(ep_axes)
  return jnp.full((ep,), me * block, jnp.int32), all_to_all(lay.counts, ep_axes)


def _send_ragged(rows, ids, lay: Layout, block: int, ep_axes, fill: int):
  """Packed rows over jax.lax.ragged_all_to_all into the same [P * block] layout as _send_dense."""
  ep = lay.counts.shape[0]
  out_off, recv = _ragged_offsets(lay, block, ep_axes)
  starts = lay.starts.astype(jnp.int32)
  move = lambda x, out: jax.lax.ragged_all_to_all(x, out, starts, lay.counts, out_off, recv, axis_name=ep_axes)  # noqa: E731
  got = move(rows, jnp.zeros((ep * block, rows.shape[-1]), rows.dtype))
  got_ids = move(ids[:, None].astype(jnp.int32), jnp.full((ep * block, 1), fill, jnp.int32))
  return got, got_ids[:, 0]


def _return_ragged(out, lay: Layout, block: int, ep_axes):
  ep = lay.counts.shape[0]
  _, recv = _ragged_offsets(lay, block, ep_axes)
  back_off = all_to_all(lay.starts.astype(jnp.int32), ep_axes)  # where each source keeps my rows
  in_off = jnp.arange(ep, dtype=jnp.int32) * block
  empty = jnp.zeros((lay.order.shape[0], out.shape[-1]), out.dtype)
  return jax.lax.ragged_all_to_all(out, empty, in_off, recv, back_off, lay.counts, axis_name=ep_axes)


def dropless(
  tokens: jax.Array, experts: jax.Array, wi_0, wi_1, wo, *biases, num_experts: int, ep_axes: tuple[str, ...],
  ep: int, glu: Callable, ragged: bool,
) -> jax.Array:  # fmt: skip
  """One shard: tokens [X, D], experts [X, k] (global ids), local weights [E_l, D, F] / [E_l, F, D] (and
  [E_l, F] biases of wi_0, wi_1) -> [X, k, D], each assignment's expert output. ragged: move packed rows
  (TPU/GPU), else padded blocks."""
  x, k = experts.shape
  local = num_experts // ep
  lay = layout(experts, local, ep)
  block = x * min(k, local)
  rows = jnp.take(tokens, lay.order // k, axis=0)  # [A, D], expert-sorted
  if not ep_axes:  # every expert is here: the sorted rows are already in groups, nothing moves
    sizes = jnp.bincount(experts.reshape(-1), length=local).astype(jnp.int32)
    out = grouped_mlp(rows, sizes, wi_0, wi_1, wo, glu, *biases)
    return jnp.take(out, inverse(lay.order), axis=0).reshape(x, k, -1)
  ids = experts.reshape(-1)[lay.order] % local
  send, back = (_send_ragged, _return_ragged) if ragged and ep_axes else (_send_dense, _return_dense)
  recv, recv_ids = send(rows, ids, lay, block, ep_axes, local)
  order = jnp.argsort(recv_ids, stable=True)  # padding (id = local) last
  sizes = jnp.bincount(recv_ids, length=local).astype(jnp.int32)
  out = grouped_mlp(jnp.take(recv, order, axis=0), sizes, wi_0, wi_1, wo, glu, *biases)
  out = jnp.take(out, inverse(order), axis=0)  # [P * block, D] in received order
  sorted_out = back(out, lay, block, ep_axes)
  return jnp.take(sorted_out, inverse(lay.order), axis=0).reshape(x, k, -1)


def capacity(
  tokens: jax.Array, experts: jax.Array, wi_0, wi_1, wo, *biases, num_experts: int, ep_axes: tuple[str, ...],
  ep: int, groups: int, capacity_factor: float, glu: Callable,
) -> jax.Array:  # fmt: skip
  """One shard: tokens [X, D], experts [X, k], local weights -> [X, k, D], 0 for the assignments beyond
  their expert's capacity in their group (X split into `groups` runs of consecutive tokens)."""
  x, k = experts.shape
  e, d, g = num_experts, tokens.shape[-1], groups
  c = expert_capacity(x // g, k, e, capacity_factor)
  ranks = jax.vmap(expert_ranks, in_axes=(0, None))(experts.reshape(g, x // g, k), e).reshape(x, k)
  group = (jnp.arange(x) // (x // g))[:, None]
  # Slot in the flattened [E, G*C] buffer: expert, then group, then rank; dropped ones point past the end.
  slots = jnp.where(ranks < c, experts * (g * c) + group * c + ranks, e * g * c).reshape(-1)  # [A]
  routed = jnp.repeat(tokens, k, axis=0)  # [A, D]
  buffer = jnp.zeros((e * g * c, d), tokens.dtype).at[slots].set(routed, mode="drop")
  # [E, S, D] = [P, E_l, S, D] -> all-to-all -> [P (source), E_l, S, D] -> [E_l, P*S, D]
  local = e // ep
  buffer = all_to_all(buffer.reshape(ep, local, g * c, d), ep_axes)
  buffer = buffer.transpose(1, 0, 2, 3).reshape(local, ep * g * c, d)
  hidden = expert_hidden(buffer, wi_0, wi_1, glu, *biases)
  out = jnp.einsum("ECF,EFD->ECD", hidden, wo).reshape(local, ep, g * c, d).transpose(1, 0, 2, 3)
  out = all_to_all(out, ep_axes).reshape(e * g * c, d)
  return jnp.take(out, slots, axis=0, mode="fill", fill_value=0).reshape(x, k, d)
