"""The frozen teacher of objective=distill (objectives/distill.py, docs/distillation.md): its own Config, built
from teacher_config, with the run settings (mesh, batch, length, platform, compute dtype) of the student's.

The teacher's params live in TrainState.reference (state.state_spec), sharded on the student's mesh by the
teacher's own logical axes; attach (called by checkpointing.restore_or_init) reads them from
teacher_load_parameters_path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

from MaxText import config as config_lib
from MaxText import paths
from MaxText.config import Config
from MaxText.errors import ConfigError

# The objectives whose TrainState.reference is a teacher read from its own checkpoint, not a copy of the params.
TEACHER_OBJECTIVES = ("distill",)

# The student's keys the teacher runs with: where and how the step runs, not what the teacher is.
RUN_KEYS = (
  "hardware",
  "num_slices",
  "mesh_axes",
  "data_sharding",
  "logical_axis_rules",
  "context_parallel_load_balance",
  "per_device_batch_size",
  "eval_per_device_batch_size",
  "max_target_length",
  "gradient_accumulation_steps",
  "compile_topology",
  "compile_topology_num_slices",
  "dtype",
)


class Teacher(NamedTuple):
  """What the train state needs of a teacher (StateSpec.teacher)."""

  config: Config  # config_of(student): the teacher's model
  path: str  # teacher_load_parameters_path: where its params are read from (teacher.attach)


def has_teacher(config: Config) -> bool:
  """Whether the run holds a teacher model: objective=distill online (offline, distill_topk_path, none runs)."""
  return config.objective in TEACHER_OBJECTIVES and not config.distill_topk_path


def _carried(student: Config) -> dict:
  values = student.to_dict()
  return {k: v for k, v in values.items() if k in RUN_KEYS or k.startswith(("ici_", "dcn_"))}


@functools.lru_cache(maxsize=8)
def config_of(student: Config) -> Config:
  """The teacher's Config: teacher_config (a config file, a recipe, a run's saved config.yml, or a model preset
  name) with the student's RUN_KEYS and ici_*/dcn_* keys and objective=lm; its params are read from
  teacher_load_parameters_path (Teacher.path). ConfigError names teacher_config when it cannot be read."""
  name = student.teacher_config
  if not name:
    raise ConfigError("objective=distill needs teacher_config: a config file, a recipe or a model preset name")
  presets = config_lib.presets()
  argv = [os.path.join(config_lib.CONFIG_DIR, "base.yml"), f"model_name={name}"] if name in presets else [name]
  try:
    teacher = config_lib.load(argv, {})
    changes = _carried(student) | {"load_parameters_path": "", "load_full_state_path": ""}
    changes |= {"objective": "lm", "use_dpo": False, "lora_rank": 0, "mtp_num_layers": 0, "run_name": "teacher"}
    return teacher.replace(**changes)
  except ConfigError as e:
    raise ConfigError(f"teacher_config={name!r}: {e}") from None


def of(student: Config) -> Teacher | None:
  """The student's teacher (objective=distill), else None."""
  return Teacher(config_of(student), student.teacher_load_parameters_path) if has_teacher(student) else None


def attach(spec: Any, restored: Any, read: Callable[[str, Any], Any]) -> Any:
  """checkpointing.restore_or_init's Restored with its frozen teacher (TrainState.reference) when spec (a
  state.StateSpec) has one: read(spec.teacher.path, spec.abstract.reference), checkpointing.load_params (passed in:
  checkpointing imports this module). Checkpoints never hold the teacher, so a resume reads it again here."""
  if spec.teacher is None:
    return restored
  try:
    params = read(spec.teacher.path, spec.abstract.reference)
  except ConfigError as e:
    raise ConfigError(f"teacher_load_parameters_path, read with the model of teacher_config: {e}") from None
  return restored._replace(state=restored.state.replace(reference=params))


def check(student: Config) -> None:
  """The teacher's settings the run cannot start with, each one line before anything is built."""
  teacher = config_of(student)
  path = student.teacher_load_parameters_path
  if not path or not paths.may_exist(path):
    raise ConfigError(
      f"objective=distill needs teacher_load_parameters_path (now {path!r}): the teacher's params, a checkpoint's "
      "<run dir>/checkpoints/<step>/state or a converted checkpoint's directory"
    )
  if teacher.vocab_size != student.vocab_size:
    raise ConfigError(
      f"the teacher's vocab_size={teacher.vocab_size} differs from the student's vocab_size={student.vocab_size}: "
      "distillation compares logits token by token; pick a teacher with the student's tokenizer"
    )
