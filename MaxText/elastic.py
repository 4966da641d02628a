"""Elastic resume: a run checkpointed on N devices resumes on M != N with the same global batch.

Every checkpoint records the layout it was trained with (global batch, devices, processes, the per-device
batch and gradient accumulation) in its orbax step metadata. On a resume whose command line gives another
global batch (another device count, or the same reduced count again), `keep_global_batch` sets
per_device_batch_size = global batch / M and picks gradient_accumulation_steps so
that the rows one device holds per micro-batch (what sets its activation memory) do not grow; it says so
in one line, or stops with one line naming the keys to set when the global batch cannot be kept. The
data position needs nothing more: every pipeline stores it in global terms (batches.py: a global row
number; grain_data.py: the state of each of a fixed number of record shards), so with the same global
batch the next example is the one an uninterrupted run would have read.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import jax
from etils import epath
from jax.sharding import Mesh

from MaxText import sharding
from MaxText.config import Config
from MaxText.errors import ConfigError

METADATA_KEY = "layout"  # in each checkpoint step's orbax custom metadata
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step metadata (JSON) in <checkpoints>/<step>/


class Layout(NamedTuple):
  """How a checkpointed run was batched and spread; JSON in the checkpoint's metadata."""

  global_batch: int  # sequences per optimizer step
  devices: int
  processes: int
  per_device_batch_size: float
  gradient_accumulation_steps: int


def layout(config: Config, mesh: Mesh) -> dict[str, Any]:
  """This run's layout, as checkpointing.save records it."""
  batch = sharding.global_batch_size(config, mesh)
  micro = config.gradient_accumulation_steps
  return {METADATA_KEY: Layout(batch, mesh.size, jax.process_count(), config.per_device_batch_size, micro)._asdict()}


def saved_layout(checkpoint_dir: str) -> Layout | None:
  """The layout recorded with the newest committed checkpoint under `checkpoint_dir` that has one; None for
  a fresh run or checkpoints written before layouts were recorded."""
  root = epath.Path(checkpoint_dir)
  if not root.exists():
    return None
  steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
  for step in steps:
    path = root / str(step) / STEP_METADATA_FILE
    try:
      recorded = (json.loads(path.read_text()).get("custom_metadata") or {}).get(METADATA_KEY)
    except (OSError, ValueError):  # a damaged step: restore falls back past it too
      continue
    if recorded:
      return Layout(**recorded)
  return None


def keep_global_batch(config: Config, mesh: Mesh, saved: Layout | None) -> tuple[Config, str | None]:
  """The config a resume on `mesh` trains with, and the line that says what changed (None: nothing).

  With elastic_resume, whenever the command line's global batch is not the checkpoint's (another number of
  devices; also the same number again after an elastic resume, when the command line still gives the first
  run's per-device batch), per_device_batch_size becomes saved.global_batch / mesh.size and
  gradient_accumulation_steps the smallest count (at least the one that keeps each device's rows per
  micro-batch) that splits the batch over the mesh. ConfigError when none does."""
  if saved is None or not config.elastic_resume:
    return config, None
  batch = saved.global_batch
  per_device = batch / mesh.size
  if math.isclose(config.per_device_batch_size * mesh.size, batch) and _fits(config, mesh):  # set so already
    if saved.devices == mesh.size:
      return config, None
    return config, f"resuming on {mesh.size} devices (was {saved.devices}) with the same global batch {batch}"
  rows = saved.per_device_batch_size / saved.gradient_accumulation_steps  # per device per micro-batch
  least = max(1, math.ceil(per_device / rows - 1e-9))
  # Fewer micro-batches than `least` would hold more rows per device than the saved run did: tried last.
  for micro in [*range(least, batch + 1), *range(least - 1, 0, -1)]:
    candidate = config.replace(per_device_batch_size=per_device, gradient_accumulation_steps=micro)
    if batch % micro == 0 and _fits(candidate, mesh):
      return candidate, _note(config, candidate, mesh, saved)
  shards = math.prod(mesh.shape[a] for a in sharding.data_axes(config))
  counts = [n for n in range(1, batch + 1) if batch % n == 0]
  near = [
    max((n for n in counts if n < mesh.size), default=None),
    min((n for n in counts if n > mesh.size), default=None),
  ]
  raise ConfigError(
    f"cannot keep the global batch {batch} of the checkpoint (saved on {saved.devices} devices) on {mesh.size} "
    f"devices: {batch} rows do not split over the {shards} batch shards of this mesh; resume on a device count "
    f"that divides {batch} (e.g. {' or '.join(str(n) for n in near if n)}), or set elastic_resume=false and "
    "per_device_batch_size (with gradient_accumulation_steps) to train on with another global batch"
  )


def _fits(config: Config, mesh: Mesh) -> bool:
  try:
    sharding.global_batch_size(config, mesh)
  except ConfigError:
    return False
  return True


def _note(old: Config, new: Config, mesh: Mesh, saved: Layout) -> str:
  changes = []
  for key in ("per_device_batch_size", "gradient_accumulation_steps"):
    if new[key] != old[key]:
      changes.append(f"{key} {old[key]:g} -> {new[key]:g}")
  was = f" (was {saved.devices})" if saved.devices != mesh.size else ""
  return f"resuming on {mesh.size} devices{was}: {', '.join(changes)} to keep the global batch {saved.global_batch}"


def resume_config(config: Config, mesh: Mesh) -> Config:
  """keep_global_batch for this run's checkpoints (when it resumes), printing its line (writer process)."""
  if not config.enable_checkpointing:
    return config
  config, note = keep_global_batch(config, mesh, saved_layout(config.checkpoint_dir))
  if note and jax.process_index() == 0:
    print(note, flush=True)
  return config
