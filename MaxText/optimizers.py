"""AdamW with gradient clipping and a warm-up + cosine learning-rate schedule, from the config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import optax

from MaxText.config import Config


class Optimizer(NamedTuple):
  tx: optax.GradientTransformation  # clip -> AdamW, driven by `schedule`
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
  if config.gradient_clipping_threshold > 0:
    return Optimizer(optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw), schedule)
  return Optimizer(adamw, schedule)
