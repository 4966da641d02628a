"""The per-shard wrappers: pieces of the model that XLA cannot partition by itself run here under
`jax.shard_map` over the plan's mesh, with the mesh axes the plan resolved (plan.Axes). The model calls
these with its single-device maths as a function; without a mesh (plan.mesh is None) they call it directly.

- flash attention (a Pallas kernel is opaque to the partitioner): batch and heads split, sequence whole;
- context-parallel attention: queries stay split along the sequence, keys/values are all-gathered;
- MoE routing and expert dispatch: per batch shard, experts over the expert axes, widths over mlp;
- TPU lane layouts of narrow weight shards (sharding.keep_lanes).
A dimension that does not divide its axes' size stays whole (computed redundantly, still correct).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText import sharding

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan


def _size(axes: tuple[str, ...], mesh) -> int:
  return math.prod(mesh.shape[a] for a in axes)


class HeadSplit(NamedTuple):
  """How attention splits [B, T, N, H] arrays per shard: specs of q (and the output), k/v, segment ids, and
  whether k/v are first repeated to one head per query head (kv heads too few to split like the query heads)."""

  q: P
  kv: P
  segment_ids: P
  repeat_kv: bool


def head_split(plan: Plan, q_shape: tuple[int, ...], k_shape: tuple[int, ...], length_axes=()) -> HeadSplit:
  """Batch over the batch axes and heads over the heads axes where they divide; the sequence over
  `length_axes` (context parallelism) or whole, head_dim whole."""
  axes, mesh = plan.axes, plan.mesh
  batch = axes.batch if axes.batch and q_shape[0] % _size(axes.batch, mesh) == 0 else None
  heads = axes.heads if axes.heads and q_shape[2] % _size(axes.heads, mesh) == 0 else None
  # GQA keeps query head n on kv head n // G; per shard that holds when both head counts split evenly
  # over the same axes. Otherwise k/v are repeated to N heads and split like q.
  repeat_kv = heads is not None and (axes.kv_heads != heads or k_shape[2] % _size(heads, mesh) != 0)
  seq = None if not length_axes else length_axes if len(length_axes) > 1 else length_axes[0]
  q_spec = P(batch, seq, heads, None)
  return HeadSplit(q=q_spec, kv=q_spec, segment_ids=P(batch, seq), repeat_kv=repeat_kv)


def _repeat_kv(split: HeadSplit, q, k, v):
  if not split.repeat_kv:
    return k, v
  group = q.shape[2] // k.shape[2]
  return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)


def flash(plan: Plan, kernel: Callable, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """kernel(q, k, v, segment_ids) on local arrays (the whole sequence), per batch/head shard; on the plan's
  attention.batch_pieces parts of each shard's batch in turn (flash_pieces: planner.Pieces)."""
  kernel = _in_batch_pieces(kernel, plan.attention.batch_pieces)
  if plan.mesh is None:
    return kernel(q, k, v, segment_ids)
  split = head_split(plan, q.shape, k.shape)
  k, v = _repeat_kv(split, q, k, v)
  return jax.shard_map(
    kernel,
    mesh=plan.mesh,
    in_specs=(split.q, split.kv, split.kv, split.segment_ids),
    out_specs=split.q,
    check_vma=False,  # pallas_call carries no varying-manual-axes annotations
  )(q, k, v, segment_ids)


def _in_batch_pieces(kernel: Callable, pieces: int) -> Callable:
  """kernel on `pieces` parts of its arguments' batch (axis 0) in turn, under lax.map: each call's
  workspace and residuals (the splash kernel writes its log-sum-exp 128 lanes wide) are a part's. Whole where
  the local batch does not divide."""
  if pieces == 1:
    return kernel

  def in_pieces(*args: jax.Array) -> jax.Array:
    if args[0].shape[0] % pieces:
      return kernel(*args)
    parts = [a.reshape(pieces, a.shape[0] // pieces, *a.shape[1:]) for a in args]
    out = jax.lax.map(lambda part: kernel(*part), parts)
    return out.reshape(-1, *out.shape[2:])

  return in_pieces


def context_attention(
  plan: Plan, local: Callable, original_index: np.ndarray, q: jax.Array, k: jax.Array, v: jax.Array,
  segment_ids: jax.Array, tokens: Callable,
) -> jax.Array:  # fmt: skip
  """Context-parallel attention: q [B, T, N, H], k [B, T, K, H], v [B, T, K, Hv], segment_ids [B, T], split
  along T over the plan's length axes -> [B, T, N, Hv]. Each shard keeps its queries and all-gathers the
  keys/values and their segment ids; `tokens(q_segments, k_segments, q_index, k_index)` packs the mask
  inputs for `local(q, k, v, tokens)`. `original_index` [T]: each place's place in the original order."""
  axes = plan.axes.length
  split = head_split(plan, q.shape, k.shape, axes)
  k, v = _repeat_kv(split, q, k, v)
  gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=1, tiled=True)

  def body(q, k, v, segments):
    t = q.shape[1]
    start = jax.lax.axis_index(axes) * t
    k_index = jnp.asarray(original_index)
    mask_inputs = tokens(segments, gather(segments), jax.lax.dynamic_slice_in_dim(k_index, start, t), k_index)
    return local(q, gather(k), gather(v), mask_inputs)

  specs = (split.q, split.kv, split.kv, split.segment_ids)
  return jax.shard_map(body, mesh=plan.mesh, in_specs=specs, out_specs=split.q)(q, k, v, segment_ids)


def per_batch_shard(plan: Plan, fn: Callable, rows: jax.Array, *replicated: jax.Array, out: Any) -> Any:
  """fn(rows, *replicated) per batch shard: rows [X, ...] split over the batch axes, the other arguments
  whole on every shard; `out` is a pytree of the outputs' row-split-ness (True: split like rows). Runs
  on the whole array where there is no mesh or X does not divide."""
  batch = plan.axes.batch
  if plan.mesh is None or not batch or rows.shape[0] % _size(batch, plan.mesh):
    return fn(rows, *replicated)
  spec = lambda r: P(batch, *(None,) * (r - 1))  # noqa: E731
  in_specs = (spec(rows.ndim), *(P(*(None,) * x.ndim) for x in replicated))
  out_specs = jax.tree.map(lambda rank: spec(rank), out)
  return jax.shard_map(fn, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs)(rows, *replicated)


def varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """x marked as varying over `axes` inside a shard_map (identity forward; its cotangent is summed over
  them). Quantized matmuls (Qwix) are custom VJPs, whose cotangents must vary over the same axes as their
  operands: with every operand varying over all the product's axes they do. Plain matmuls need no marking
  (JAX inserts it), so experts() marks only under quantization, keeping the unquantized program as it was."""
  missing = tuple(a for a in dict.fromkeys(axes) if a not in jax.typeof(x).mat.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def experts(
  plan: Plan, compute: Callable, tokens: jax.Array, assignments: jax.Array, weights: tuple[jax.Array, ...],
  num_experts: int, rows: int,
) -> jax.Array:  # fmt: skip
  """compute(tokens, assignments, wi_0, wi_1, wo[, wi_0 and wi_1 biases], ep_axes=, ep=) per batch shard (on
  the whole batch with ep=1 where there is no mesh or the batch or experts do not split evenly). `rows`: how
  many units of the batch must split over the batch axes (tokens, or whole sequences). Expert widths split over the mlp
  axes are summed after (each shard of F gives a partial sum over F)."""
  mesh, axes = plan.mesh, plan.axes
  if mesh is None:
    return compute(tokens, assignments, *weights, ep_axes=(), ep=1)
  batch, ep_axes = axes.batch, axes.experts
  ep = _size(ep_axes, mesh)
  if rows % _size(batch, mesh) or not set(ep_axes) <= set(batch) or num_experts % ep:
    return compute(tokens, assignments, *weights, ep_axes=(), ep=1)
  mlp = axes.mlp if weights[0].shape[-1] % _size(axes.mlp, mesh) == 0 else ()
  vary = (*batch, *ep_axes, *mlp) if plan.moe is not None and plan.moe.vary_for_quantization else ()

  def shard(tokens, assignments, *weights):
    tokens, *weights = (varying(x, vary) for x in (tokens, *weights))
    out = compute(tokens, assignments, *weights, ep_axes=ep_axes, ep=ep)
    return jax.lax.psum(out, mlp) if mlp else out

  b, e, f = batch or None, ep_axes or None, mlp or None
  biases = (P(e, f),) * (len(weights) - 3)  # gpt-oss: wi_0's and wi_1's [E, F] biases, split like their columns
  return jax.shard_map(
    shard,
    mesh=mesh,
    in_specs=(P(b, None), P(b, None), P(e, None, f), P(e, None, f), P(e, f, None), *biases),
    out_specs=P(b, None, None),
  )(tokens, assignments, *weights)


def keep_lanes(plan: Plan, w: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
  """w (logical axis names `logical`) with sharding.keep_lanes's layout constraint when the plan keeps
  lanes (TPU targets); elsewhere unchanged."""
  if not plan.keep_lanes or len(logical) != w.ndim:
    return w
  named = sharding.fit(NamedSharding(plan.mesh, nn.logical_to_mesh_axes(logical, plan.rules)), w.shape)
  return sharding.keep_lanes(w, named)
