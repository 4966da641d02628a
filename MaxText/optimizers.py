"""AdamW with gradient clipping and a warm-up + cosine learning-rate schedule, from the config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from MaxText.config import Config


class Optimizer(NamedTuple):
  tx: optax.GradientTransformation  # clip -> AdamW, driven by `schedule` (in skip_spikes when enabled)
  schedule: optax.Schedule  # optimizer step -> learning rate (logged by the train step)


def learning_rate_schedule(config: Config) -> optax.Schedule:
  """Linear warm-up from 0 to learning_rate over warmup_steps_fraction of the schedule, then cosine
  decay to cosine_learning_rate_final_fraction x learning_rate at learning_rate_schedule_steps, then
  constant at that value."""
  total = config.learning_rate_schedule_steps_resolved
  warmup = int(config.warmup_steps_fraction * total)
  peak, final = config.learning_rate, config.learning_rate * config.cosine_learning_rate_final_fraction
  parts = [optax.linear_schedule(0.0, peak, warmup)] if warmup else []
  parts.append(optax.cosine_decay_schedule(peak, max(total - warmup, 1), alpha=final / peak if peak else 0.0))
  parts.append(optax.constant_schedule(final))
  boundaries = [warmup, total] if warmup else [total]
  return optax.join_schedules(parts, boundaries)


def resumed_schedule(config: Config, previous: Mapping[str, Any] | None) -> tuple[Config, str | None]:
  """The config a resume trains with, and a note for the user when the schedule is kept.

  `previous` is the resolved config the run was started with (its config.yml), None for a fresh run.
  With learning_rate_schedule_steps=-1 the schedule spans `steps`, so raising steps on a resume would
  silently stretch it: the learning rate at the resume point would jump up to where the longer cosine
  is. Instead the schedule of the run being resumed is kept (after its end the rate stays at the final
  value); an explicit learning_rate_schedule_steps always wins.
  """
  if previous is None or config.learning_rate_schedule_steps != -1:
    return config, None
  kept = previous.get("learning_rate_schedule_steps_resolved")
  if not isinstance(kept, int) or kept == config.learning_rate_schedule_steps_resolved:
    return config, None
  note = (
    f"steps={config.steps} on a run started with a {kept}-step learning-rate schedule: keeping that schedule "
    f"(after step {kept} the rate stays at {config.learning_rate * config.cosine_learning_rate_final_fraction:g}); "
    f"pass learning_rate_schedule_steps={config.steps} to stretch it to the new length instead"
  )
  return config.replace(learning_rate_schedule_steps=kept), note


class SpikeState(NamedTuple):
  """skip_spikes' state: the inner optimizer's, plus ring buffers of recent statistics."""

  inner: optax.OptState
  losses: jax.Array  # float32 [interval]: the losses of the last `interval` updates (slot = count % interval)
  grad_norms: jax.Array  # float32 [interval]: their gradient norms
  count: jax.Array  # int32 scalar: updates seen
  skipped: jax.Array  # bool scalar: whether the latest update was skipped


def _below_threshold(history: jax.Array, seen: jax.Array, value: jax.Array, factor: float) -> jax.Array:
  """value <= mean + factor x std (Bessel-corrected) of the first `seen` entries of `history`."""
  mask = jnp.arange(history.shape[0]) < seen
  mean = jnp.where(mask, history, 0.0).sum() / jnp.maximum(seen, 1)
  var = jnp.where(mask, jnp.square(history - mean), 0.0).sum() / jnp.maximum(seen - 1, 1)
  return value <= mean + factor * jnp.sqrt(var)


def skip_spikes(inner: optax.GradientTransformation, interval: int, factor: float) -> optax.GradientTransformation:
  """`inner`, except that an update whose loss or gradient norm exceeds mean + factor x std of the last
  `interval` updates is skipped: zero updates, inner state (moments, step count) unchanged. Checks start
  once max(2, interval // 2) updates are seen. Skipped values still enter the history, so a lasting change
  of level becomes the new baseline instead of blocking training. Call as
  update(grads, state, params, loss=..., grad_norm=...) with float32 scalars."""

  def init(params):
    history = jnp.zeros((interval,), jnp.float32)
    return SpikeState(inner.init(params), history, history, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.bool_))

  def update(grads, state, params=None, *, loss, grad_norm, **extra):
    seen = jnp.minimum(state.count, interval)
    normal = _below_threshold(state.losses, seen, loss, factor) & _below_threshold(
      state.grad_norms, seen, grad_norm, factor
    )
    ok = (state.count < max(2, interval // 2)) | normal
    updates, inner_state = jax.lax.cond(
      ok,
      lambda: inner.update(grads, state.inner, params, **extra),
      lambda: (jax.tree.map(jnp.zeros_like, grads), state.inner),
    )
    slot = state.count % interval
    losses = state.losses.at[slot].set(loss.astype(jnp.float32))
    grad_norms = state.grad_norms.at[slot].set(grad_norm.astype(jnp.float32))
    return updates, SpikeState(inner_state, losses, grad_norms, state.count + 1, ~ok)

  return optax.GradientTransformationExtraArgs(init, update)


def build(config: Config) -> Optimizer:
  """The optimizer (clip -> AdamW) and its schedule, built once. Gradient accumulation lives in the train step."""
  schedule = learning_rate_schedule(config)
  adamw = optax.adamw(
    schedule,
    b1=config.adam_b1,
    b2=config.adam_b2,
    eps=config.adam_eps,
    eps_root=config.adam_eps_root,
    weight_decay=config.adam_weight_decay,
  )
  tx = adamw
  if config.gradient_clipping_threshold > 0:
    tx = optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
  if config.skip_step_on_spikes:  # the train step passes loss= and grad_norm= to update()
    tx = skip_spikes(tx, config.skip_step_interval, config.skip_step_scaling_factor)
  return Optimizer(tx, schedule)
