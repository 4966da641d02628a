"""SPMD pipeline parallelism over the stage axis, inside the one compiled step.

A scanned layer stack [U, ...] (U units) is viewed as [R, S, U/(R*S), ...]: R repeats (circular
stages), S stages, each stage holding U/(R*S) consecutive units per repeat. Stage s runs units
(r*S + s)*n ... (r*S + s + 1)*n - 1 in repeat r, so a microbatch meets every unit in the stack's order
and the result equals the unpipelined stack (the parameters are the same arrays, only viewed).

The batch is cut into M microbatches. In iteration t stage s works on item k = t - s (item k is
microbatch k % M in repeat k // M); all stages run at once, as one function vmapped over the stage
dimension, whose activations are sharded over the stage mesh axis; then every stage's output moves
one stage on (a roll over that dimension, i.e. a collective permute). Stage 0 reads its input from
a buffer [M, B/M, T, D] that starts as the microbatches; the last stage writes its output back there,
where stage 0 picks it up again in the next repeat (hence M >= S when R > 1). After M*R + S - 1
iterations the buffer holds the stack's output; the S - 1 iterations in which some stage has no item
are the bubble: (S - 1) / (M*R + S - 1) of the stage-iterations compute nothing useful.

Model code names logical axes only: the stage dimension of activations is `activation_stage`, that of
the weights `layers`; base.yml's rules map both to the stage mesh axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.axes import ACTIVATION_AXES
from MaxText.parallel.plan import Schedule

STAGE_AXES = ("activation_stage", *ACTIVATION_AXES)  # [S, B/M, T, D]: one microbatch per stage
BUFFER_AXES = (None, *ACTIVATION_AXES)  # [M, B/M, T, D]: every microbatch, replicated over stages

# StageFn(params [n, ...], x [b, T, D], positions [b, T], segment_ids [b, T], first_unit, microbatch)
#   -> (x [b, T, D], aux float32 scalar): n consecutive units of a stack applied to one microbatch.
StageFn = Callable[..., tuple[jax.Array, jax.Array]]


def _constrain(var: nnx.Variable, value: jax.Array, extra: int) -> nnx.Variable:
  """var holding `value`, constrained to var's logical sharding with `extra` unsharded dims inserted after
  the first (the stacked `layers` dim, which holds the stage dimension in every view)."""
  names = tuple(var.get_metadata().get("out_sharding") or (None,) * (value.ndim - extra))
  return var.replace(nn.with_logical_constraint(value, (names[0], *(None,) * extra, *names[1:])))


def _is_var(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _view(params: nnx.State, sched: Schedule) -> nnx.State:
  """Stacked params [U, ...] -> [S, R, U/(R*S), ...] (stage-major, so the stage dimension is first)."""

  def view(var: nnx.Variable) -> nnx.Variable:
    w = var[...].reshape(sched.repeats, sched.stages, -1, *var.shape[1:]).swapaxes(0, 1)
    return _constrain(var, w, 2)

  return jax.tree.map(view, params, is_leaf=_is_var)


def _select_repeat(weights: nnx.State, repeat: jax.Array, sched: Schedule) -> nnx.State:
  """[S, R, n, ...] -> [S, n, ...]: each stage's units of its current repeat `repeat[s]`."""

  def pick(var: nnx.Variable) -> nnx.Variable:
    if sched.repeats == 1:
      w = var[...][:, 0]
    else:
      w = jax.vmap(lambda w, r: jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False))(var[...], repeat)
    return _constrain(var, w, 1)

  return jax.tree.map(pick, weights, is_leaf=_is_var)


def _iterate(
  stage_fn: StageFn, weights: nnx.State, positions: jax.Array, segment_ids: jax.Array, sched: Schedule,
  first_unit: int, stage_axes: tuple[str, ...],
) -> Callable:  # fmt: skip
  """One pipeline iteration t as a scan body over (state [S, B/M, T, D], buffer [M, B/M, T, D], aux)."""
  s_, m_, r_ = sched
  per_stage = jax.tree.leaves(weights)[0].shape[2]
  stage_ids = jnp.arange(s_)
  body = jax.vmap(stage_fn, spmd_axis_name=stage_axes or None)
  # Queue layout: at the start of iteration t, buffer slot j holds microbatch (t + j) % M, so stage 0 reads
  # slot 0 and the last stage's finished microbatch goes to the fixed slot (1 - S) % M; the buffer then
  # rolls one slot. Static slots keep every buffer access local to a device (a dynamic index made XLA
  # gather the whole buffer across the batch shards each iteration).
  done_slot = (1 - s_) % m_

  def iteration(carry, t):
    state, buffer, aux = carry  # state [S, B/M, T, D]: each stage's output of the previous iteration
    items = t - stage_ids
    valid = (items >= 0) & (items < m_ * r_)
    items = jnp.clip(items, 0, m_ * r_ - 1)
    micro, repeat = items % m_, items // m_
    inputs = jnp.where((stage_ids == 0)[:, None, None, None], buffer[:1], jnp.roll(state, 1, axis=0))
    inputs = checkpoint_name(nn.with_logical_constraint(inputs, STAGE_AXES), "pipeline_stage_inputs")
    index = first_unit + (repeat * s_ + stage_ids) * per_stage
    stage_weights = _select_repeat(weights, repeat, sched)
    out, stage_aux = body(stage_weights, inputs, positions[micro], segment_ids[micro], index, micro)
    out = nn.with_logical_constraint(out, STAGE_AXES)
    buffer = buffer.at[done_slot].set(jnp.where(valid[-1], out[-1], buffer[done_slot]))
    buffer = nn.with_logical_constraint(jnp.roll(buffer, -1, axis=0), BUFFER_AXES)
    aux = aux + jnp.sum(jnp.where(valid, stage_aux, 0.0))
    return (out, buffer, aux), None

  # The backward pass keeps only each iteration's stage inputs and runs the stages again (under their own
  # remat_policy); otherwise an iteration's residuals would include the weights it selected, with
  # num_pipeline_repeats > 1 a copy of every stage's weights per iteration.
  return jax.checkpoint(iteration, policy=jax.checkpoint_policies.save_only_these_names("pipeline_stage_inputs"))


def run(
  stage_fn: StageFn,
  params: nnx.State,
  x: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  sched: Schedule,
  first_unit: int,
  stage_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, jax.Array]:
  """Apply the stacked units `params` [U, ...] to x [B, T, D] as a pipeline; returns (x [B, T, D], aux),
  aux being the stack's auxiliary loss summed over units and averaged over microbatches.

  Microbatch m takes rows m, m+M, ... so that every data shard holds a share of each microbatch.
  `stage_axes`: the mesh axes of `activation_stage` (the run plan's), over which the stages' work splits.
  """
  s_, m_, _ = sched
  b = x.shape[0]
  if b % m_:  # the plan and sharding.global_batch_size check the training batch; this is a caller's mistake
    raise ValueError(f"a batch of {b} rows does not split into {m_} pipeline microbatches")

  def split(a):  # [B, ...] -> [M, B/M, ...]
    return a.reshape(b // m_, m_, *a.shape[1:]).swapaxes(0, 1)

  buffer = nn.with_logical_constraint(split(x), BUFFER_AXES)
  positions, segment_ids = split(positions), split(segment_ids)
  # Constrained to their own sharding, so that their gradient (the constraint's transpose) is too.
  params = jax.tree.map(lambda var: _constrain(var, var[...], 0), params, is_leaf=_is_var)
  iteration = _iterate(stage_fn, _view(params, sched), positions, segment_ids, sched, first_unit, stage_axes)
  state = jnp.zeros((s_, *buffer.shape[1:]), x.dtype)
  carry = (nn.with_logical_constraint(state, STAGE_AXES), buffer, jnp.zeros((), jnp.float32))
  (_, buffer, aux), _ = jax.lax.scan(iteration, carry, jnp.arange(sched.iterations))
  buffer = jnp.roll(buffer, sched.iterations, axis=0)  # slot m: microbatch m
  return nn.with_logical_constraint(buffer.swapaxes(0, 1).reshape(x.shape), ACTIVATION_AXES), aux / m_
