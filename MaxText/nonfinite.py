"""What a run whose updates fail says and does (docs/failures.md): the non-finite check of each step, where a rerun
resumes and what to change so that it does not fail again, and the verdict on a run whose updates were mostly
skipped.

The loss and the update of step N+1 come from the state after N steps (with the batch and the learning rate). When
that state is a checkpoint, a rerun resumes from it, so the advice never sends the user back to it unchanged: a
checkpoint the run had just resumed from is first read again and checked against its checksums (damage is moved
aside and the rerun falls back a step); an intact one that gives a non-finite loss is set aside on the rerun (its
own loss is non-finite at any learning rate); one that gives a non-finite update needs a lower learning rate, or
moving it aside by hand to fall back a step.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from MaxText import checkpointing, checksums, paths
from MaxText.config import Config
from MaxText.errors import CheckpointError

LOWER = "lower learning_rate (or raise warmup_steps_fraction, set gradient_clipping_threshold, use dtype=float32)"
MOSTLY = 0.5  # a run that skipped more than this fraction of its updates exits non-zero


class NonFiniteLossError(RuntimeError):
  """The loss or the update went NaN/inf; that update was not applied and nothing non-finite was saved."""

  def __init__(self, message: str, step: int, loss_finite: bool):
    super().__init__(message)
    self.step = step  # steps completed, the failed one included
    self.loss_finite = loss_finite  # True: only the update was not finite

  @property
  def state_step(self) -> int:
    """The state (steps completed) this loss and update came from."""
    return self.step - 1


class SkippedUpdatesError(RuntimeError):
  """More than MOSTLY of a run's updates were skipped (non-finite, or loss spikes): the model barely trained."""


def check_finite(config: Config, step: int, scalars: dict[str, float]) -> None:
  """nan_check: stop on a non-finite loss or update (the train step did not apply the update; the loop
  checks a step before any checkpoint that includes it). `step` counts completed steps."""
  if not config.nan_check or (math.isfinite(scalars["loss"]) and scalars.get("update_finite", 1.0) > 0):
    return
  loss_finite = math.isfinite(scalars["loss"])
  what = "the update is not finite" if loss_finite else f"loss is {scalars['loss']}"
  message = f"{what} at step {step} (grad norm {scalars.get('grad_norm')}); that update was not applied or saved."
  raise NonFiniteLossError(message, step, loss_finite)


def advice(config: Config, manager: Any, error: NonFiniteLossError, resumed: int | None, abstract: Any) -> str:
  """`error`'s message, completed with what to change and where a rerun with the same run_name begins (waits for
  in-flight saves). `resumed`: the checkpoint step this run resumed from, if any; `abstract`: the saved state's
  shapes and shardings, to read that step again."""
  rerun = f"{LOWER[0].upper()}{LOWER[1:]} and rerun with the same run_name."
  if manager is None:
    return f"{error} {rerun} Checkpointing is off, so a rerun begins at step 0."
  with contextlib.suppress(CheckpointError):  # a failed save is reported by finish(); here it is just not a step
    checkpointing.wait_for_saves(manager)
  steps, failed = checkpointing.committed_steps(str(manager.directory)), error.state_step
  if failed not in steps:  # the last checkpoint gave good updates after it
    return f"{error} {rerun} {_resumes(config, manager, steps)}"
  earlier = [s for s in steps if s < failed]
  verified = ""
  if failed == resumed:
    damage = _damage(config, manager, abstract, failed)
    if damage is not None:
      moved = checkpointing.move_aside(config, failed, checkpointing.UNREADABLE_DIR)
      line = f"checkpoint step {failed}, which this run resumed from, is damaged ({damage}); moved it to {moved}"
      checkpointing.say(line)
      return f"{error} The state it came from is damaged: {line}. {_resumes(config, manager, earlier)}"
    verified = f" Checkpoint step {failed}, which this run resumed from, {_verified(config, failed)}."
  if not error.loss_finite:  # the loss depends only on the state and the batch: the rerun sets the step aside
    if jax.process_index() == 0:
      (epath.Path(config.run_dir) / checkpointing.NONFINITE_FILE).write_text(json.dumps([failed]))
    aside = checkpointing.NONFINITE_DIR
    note = f" (checkpoint {failed} itself gives this loss: the rerun moves it to {aside}/)"
    return f"{error}{verified} {rerun} {_resumes(config, manager, earlier)[:-1]}{note}."
  fallback = paths.join(config.run_dir, checkpointing.NONFINITE_DIR, str(failed))
  back = f"step {earlier[-1]}" if earlier else "step 0 (no earlier checkpoint)"
  return (
    f"{error}{verified} The update came from checkpoint step {failed}, and a rerun resumes from that same state: "
    f"{LOWER} and rerun with the same run_name, or fall back to an earlier state: move "
    f"{manager.directory / str(failed)} to {fallback} and rerun, which resumes from {back}."
  )


def _resumes(config: Config, manager: Any, steps: list[int]) -> str:
  if steps:
    return f"A rerun resumes from the last good checkpoint, step {steps[-1]} ({manager.directory / str(steps[-1])})."
  if config.load_full_state_path:
    return "No earlier checkpoint was saved, so a rerun starts again from load_full_state_path."
  return "No earlier checkpoint was saved, so a rerun begins at step 0."


def _verified(config: Config, step: int) -> str:
  if checksums.saved(paths.join(config.checkpoint_dir, str(step))) is None:
    return "carries no checksums, so damage to it cannot be ruled out"
  return "was read again and matches its checksums: the state is as saved, not damaged"


def _damage(config: Config, manager: Any, abstract: Any, step: int) -> str | None:
  """Why checkpoint `step` is damaged, read again and checked against its checksums; None when it matches (or
  carries none: nothing to check it against)."""
  step_dir = paths.join(config.checkpoint_dir, str(step))
  if checksums.saved(step_dir) is None:
    return None
  try:
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    checksums.verify(step_dir, restored.state, f"checkpoint step {step}")
  except Exception as e:  # noqa: BLE001 (unreadable now is damage, as at a resume)
    return checkpointing.one_line(e)
  return None


def check_skipped(summary: dict[str, Any]) -> None:
  """SkippedUpdatesError when more than MOSTLY of the steps run had their update skipped."""
  run, skipped = summary.get("steps_run", 0), summary.get("skipped_steps", 0)
  if run and skipped > MOSTLY * run:
    raise SkippedUpdatesError(
      f"{skipped} of the {run} updates of this run were skipped (not finite, or a loss spike): the model barely "
      f"trained. {LOWER[0].upper()}{LOWER[1:]}, or with skip_step_on_spikes raise skip_step_scaling_factor; "
      "the checkpoints are kept, and a rerun with the same run_name resumes from the last one."
    )
