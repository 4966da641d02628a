"""The optimizer (opt_type: AdamW by default; Praxis' Adam, SGD, Adafactor, Muon) with gradient clipping, an
optional weight-decay mask and a warm-up + cosine learning-rate schedule, from the config."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from MaxText.config import Config


class Optimizer(NamedTuple):
  tx: optax.GradientTransformation  # clip -> opt_type's optimizer, driven by `schedule` (in skip_spikes when enabled)
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


def param_path(path: tuple[Any, ...]) -> str:
  """A parameter's jax key path as "layers/mlp/wi/0/kernel" (nnx.Variable's own "value" key dropped): what
  adamw_mask's patterns and FIXED_PARAMS are matched against."""
  keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
  return "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)


def _path_mask(patterns: list[str] | tuple[str, ...], matched: bool) -> Callable[[Any], Any]:
  """params -> a tree of bools like params: `matched` where a pattern re.search-es the param_path, else not."""
  compiled = [re.compile(p) for p in patterns]

  def mask(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: any(p.search(param_path(path)) for p in compiled) == matched, params
    )

  return mask


def decay_mask(config: Config) -> Callable[[Any], Any] | None:
  """Which parameters weight decay applies to: all (None) unless adamw_mask lists patterns to leave out."""
  return _path_mask(config.adamw_mask, matched=False) if config.adamw_mask else None


# Logical axes that index independent matrices (stacked layers, experts): Muon orthogonalises each slice.
MUON_BATCH_AXES = ("layers", "exp", "stage")


def muon_dimensions(path: tuple[Any, ...], param: Any) -> MuonDimensionNumbers | None:
  """How Muon sees one parameter: its reduction (input) and output axes from the logical axis names of its
  metadata, or None for AdamW. A matrix has two or more axes besides MUON_BATCH_AXES; embeddings and the
  output head (a `vocab` axis), norms and biases go to AdamW, as in Muon's usual setup. The input side is
  the first remaining axis, unless `embed` ends the kernel (attention out [N, H, D], MLP wo [F, D]): then
  every axis before it. Kernels are stored [in..., out...] (DenseGeneral), experts [E, in, out]."""
  if not isinstance(param, nnx.Variable) or not hasattr(param.get_value(), "ndim"):
    return None  # inside optax's partition: another optimizer's parameter
  ndim = param.get_value().ndim
  names = tuple(param.get_metadata().get("out_sharding") or ())
  names = names if len(names) == ndim else (None,) * ndim
  axes = [i for i, n in enumerate(names) if n not in MUON_BATCH_AXES]
  if len(axes) < 2 or "vocab" in names or "norm" in names or param_path(path).endswith("bias"):
    return None
  if names[axes[-1]] == "embed" and names[axes[0]] != "embed":
    return MuonDimensionNumbers(tuple(axes[:-1]), (axes[-1],))
  return MuonDimensionNumbers((axes[0],), tuple(axes[1:]))


def _is_param(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _muon(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  """optax's Muon (Nesterov momentum, Newton-Schulz orthogonalised) on the matrices muon_dimensions picks,
  AdamW (adam_* keys) on the rest; adamw_mask applies to both parts' weight decay."""
  dims = lambda params: jax.tree_util.tree_map_with_path(muon_dimensions, params, is_leaf=_is_param)  # noqa: E731
  mask = decay_mask(config)
  muon = optax.contrib.muon(
    schedule,
    beta=config.muon_beta,
    eps=config.adam_eps,
    weight_decay=config.muon_weight_decay,
    weight_decay_mask=mask,
    muon_weight_dimension_numbers=dims,
    consistent_rms=config.muon_consistent_rms or None,
  )

  def labels(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, p: "adam" if muon_dimensions(path, p) is None else "muon", params, is_leaf=_is_param
    )

  # optax's muon has its own AdamW part but no mask for that part's decay: ours takes the non-matrices.
  return optax.partition({"muon": muon, "adam": _adamw(config, schedule)}, labels)


def _adamw(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.adamw(
    schedule,
    b1=config.adam_b1,
    b2=config.adam_b2,
    eps=config.adam_eps,
    eps_root=config.adam_eps_root,
    weight_decay=config.adam_weight_decay,
    mask=decay_mask(config),
  )


class PaxAdamState(NamedTuple):
  count: jax.Array  # int32 scalar: updates taken
  mu: optax.Updates  # first moment, like the params
  nu: optax.Updates  # second moment


def _pax_decay(count: jax.Array, beta: float) -> jax.Array:
  """Praxis' bias-corrected decay at 0-based step `count`: beta (1 - beta^t) / (1 - beta^(t+1)), so plain
  moving averages with it need no separate bias correction (0 at the first step: the moment is g)."""
  t = count.astype(jnp.float32)
  return beta * (1.0 - beta**t) / (1.0 - beta ** (t + 1.0))


def scale_by_pax_adam(b1: float, b2: float, eps: float, eps_root: float) -> optax.GradientTransformation:
  """Adam as Praxis (sharded_adam) and MaxText's adam_pax write it: bias correction folded into the decay
  rates, update mu / (sqrt(nu + eps_root) + eps)."""

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return PaxAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

  def update(updates, state, params=None):
    d1, d2 = _pax_decay(state.count, b1), _pax_decay(state.count, b2)
    mu = jax.tree.map(lambda g, m: (1.0 - d1).astype(g.dtype) * g + d1.astype(g.dtype) * m, updates, state.mu)
    nu = jax.tree.map(lambda g, v: (1.0 - d2).astype(g.dtype) * g * g + d2.astype(g.dtype) * v, updates, state.nu)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu, nu)
    return out, PaxAdamState(state.count + 1, mu, nu)

  return optax.GradientTransformation(init, update)


def _adam_pax(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.chain(
    scale_by_pax_adam(config.adam_b1, config.adam_b2, config.adam_eps, config.adam_eps_root),
    optax.add_decayed_weights(config.adam_weight_decay, decay_mask(config)),
    optax.scale_by_learning_rate(schedule),
  )


def _sgd(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.sgd(schedule)  # plain, as MaxText's: no momentum, no weight decay


def _adafactor(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  """optax's Adafactor with learning_rate as the step size (no multiplying by the parameters' scale) and
  decoupled weight decay adam_weight_decay x learning rate, as AdamW's."""
  return optax.adafactor(
    schedule,
    min_dim_size_to_factor=config.adafactor_min_dim_size_to_factor,
    decay_rate=config.adafactor_decay_rate,
    multiply_by_parameter_scale=False,
    clipping_threshold=config.adafactor_clipping_threshold or None,
    weight_decay_rate=(lambda count: config.adam_weight_decay * schedule(count)) if config.adam_weight_decay else None,
    weight_decay_mask=decay_mask(config),
  )


# Parameters no optimizer moves: the MoE routers' selection bias (routed_bias) gets no gradient (it only picks
# experts) and is set from the expert loads (train_step.balance_router_bias); weight decay would shrink it.
FIXED_PARAMS = (r"(^|/)gate_bias$",)
VISION_PARAMS = (r"^vision_encoder/",)  # freeze_vision_encoder: the vision tower and projector (layers/vision.py)


def keep_fixed(inner: optax.GradientTransformation, patterns: tuple[str, ...]) -> optax.GradientTransformation:
  """`inner` with zero updates for the parameters whose param_path a pattern matches; its state is
  unchanged in structure (a checkpoint of `inner` restores into it)."""
  fixed = _path_mask(patterns, matched=True)

  def update(updates, state, params=None, **extra):
    updates, state = inner.update(updates, state, params, **extra)
    return jax.tree.map(lambda u, f: jnp.zeros_like(u) if f else u, updates, fixed(updates)), state

  return optax.GradientTransformationExtraArgs(inner.init, update)


# opt_type -> its builder (config, schedule) -> transformation; config.CHOICES["opt_type"] lists the same names.
OPTIMIZERS = {"adamw": _adamw, "adam_pax": _adam_pax, "sgd": _sgd, "adafactor": _adafactor, "muon": _muon}


def build(config: Config) -> Optimizer:
  """The optimizer (clip -> opt_type's) and its schedule, built once. Gradient accumulation lives in the train
  step."""
  schedule = learning_rate_schedule(config)
  base = OPTIMIZERS[config.opt_type](config, schedule)
  tx = base
  if config.gradient_clipping_threshold > 0:
    tx = optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), base)
  fixed = FIXED_PARAMS if config.routed_bias else ()
  if config.use_multimodal and config.freeze_vision_encoder:  # no weight decay either
    fixed += VISION_PARAMS
  if fixed:
    tx = keep_fixed(tx, fixed)
  if config.skip_step_on_spikes:  # the train step passes loss= and grad_norm= to update()
    tx = skip_spikes(tx, config.skip_step_interval, config.skip_step_scaling_factor)
  return Optimizer(tx, schedule)
