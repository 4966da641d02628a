"""Orbax checkpoints: resume > load_full_state_path > load_parameters_path > fresh init.

Layout: <run dir>/checkpoints/<step>/{state, data}: `state` is the TrainState (params, optimizer,
step), `data` the input iterator's JSON state. Orbax writes each step to a temporary directory and
renames it when complete, so a crash or kill mid-save leaves the previous checkpoint intact and the
partial one is ignored. Restores go straight into the sharded layout of the abstract state.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from MaxText import state as state_lib
from MaxText.config import Config, ConfigError
from MaxText.state import StateSpec, TrainState


class Restored(NamedTuple):
  state: TrainState
  data_state: dict | None  # the iterator state saved with it (resume only)
  source: str  # "resume from step N" | "load_full_state_path" | "load_parameters_path" | "init"


def create_manager(config: Config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    return None
  options = ocp.CheckpointManagerOptions(
    save_interval_steps=1,  # the train loop decides which steps are due (checkpoint_period, last step)
    max_to_keep=None if config.max_num_checkpoints_to_keep == -1 else config.max_num_checkpoints_to_keep,
    enable_async_checkpointing=config.async_checkpointing,
    create=True,
    cleanup_tmp_directories=True,
  )
  return ocp.CheckpointManager(os.path.abspath(config.checkpoint_dir), options=options, item_names=("state", "data"))


def save(manager: ocp.CheckpointManager, step: int, state: TrainState, data_state: dict) -> None:
  """Save `state` after `step` completed steps with the iterator state that follows it."""
  args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
  manager.save(step, args=args, force=True)


def restore_or_init(
  config: Config, tx: optax.GradientTransformation, spec: StateSpec, manager: ocp.CheckpointManager | None
) -> Restored:
  """The starting state, in order of precedence: this run's latest checkpoint, then the load_* paths."""
  if manager is not None and manager.latest_step() is not None:
    step = manager.latest_step()
    restored = manager.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(spec.abstract), data=ocp.args.JsonRestore())
    )
    return Restored(restored.state, restored.data, f"resume from step {step}")
  if config.load_full_state_path:
    return Restored(_restore_tree(config.load_full_state_path, spec.abstract), None, "load_full_state_path")
  fresh = state_lib.init_state(config, tx, spec)
  if config.load_parameters_path:
    params = load_params(config.load_parameters_path, spec.abstract.params)
    return Restored(fresh.replace(params=params), None, "load_parameters_path")
  return Restored(fresh, None, "init")


def _restore_tree(path: str, abstract: Any) -> Any:
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise ConfigError(f"Checkpoint {path!r} does not exist")
  try:
    return ocp.StandardCheckpointer().restore(path, abstract)
  except (ValueError, KeyError, FileNotFoundError) as e:
    raise ConfigError(f"Checkpoint {path!r} does not match this model's state: {e}") from e


def saved_tree(path: str) -> Any:
  """The tree (nested dicts of per-array metadata) of the orbax PyTree checkpoint at `path`."""
  metadata = ocp.PyTreeCheckpointer().metadata(path)
  return metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata


def load_params(path: str, abstract_params: Any) -> Any:
  """Params from `path`: a params-only checkpoint, or a train-state checkpoint's `params` subtree."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise ConfigError(f"load_parameters_path {path!r} does not exist")
  tree = saved_tree(path)
  item = {"params": abstract_params} if isinstance(tree, dict) and "params" in tree else abstract_params
  restore_args = ocp.checkpoint_utils.construct_restore_args(item)
  try:
    restored = ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    )
  except (ValueError, KeyError, FileNotFoundError) as e:
    relaid = _restore_other_layout(path, tree, abstract_params)
    if relaid is None:
      raise ConfigError(f"load_parameters_path {path!r} does not match this model's parameters: {e}") from e
    return relaid
  restored = restored["params"] if item is not abstract_params else restored
  missing = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(restored) if _is_abstract(v)]
  if missing:  # partial_restore leaves parameters the checkpoint lacks unrestored
    relaid = _restore_other_layout(path, tree, abstract_params)
    if relaid is None:
      raise ConfigError(f"load_parameters_path {path!r} lacks {missing[0]} (and {len(missing) - 1} more)")
    return relaid
  return restored


def _is_abstract(x: Any) -> bool:
  return isinstance(x, jax.ShapeDtypeStruct)


def _restore_other_layout(path: str, tree: Any, abstract_params: Any) -> Any | None:
  """A checkpoint written with the other scan_layers setting, restacked or unstacked to
  `abstract_params` (via host memory: the whole params once); None when it is not that."""
  numpy_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  saved = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=numpy_args))
  saved = saved.get("params", saved)
  target = nnx.to_pure_dict(abstract_params)
  try:
    pure = _relayout(target, saved)
  except (KeyError, ValueError, TypeError):
    return None
  placed = jax.tree.map(lambda a, t: jax.device_put(a.astype(t.dtype), t.sharding), pure, target)
  out = jax.tree.map(lambda x: x, abstract_params)
  nnx.replace_by_pure_dict(out, placed)
  return out


def _relayout(target: Any, saved: Any) -> Any:
  """saved (str keys, {'value': array} leaves) in the shape of target (a pure dict of abstract arrays):
  a stacked target subtree takes saved layers '0'..'n-1' stacked; an unrolled one slices saved stacks."""
  if isinstance(saved, dict) and set(saved) == {"value"} and not isinstance(target, dict):
    if tuple(saved["value"].shape) != tuple(target.shape):
      raise ValueError(f"shape {saved['value'].shape} != {target.shape}")
    return saved["value"]
  digits = all(k.isdigit() for k in saved)
  target_list = all(isinstance(k, int) for k in target)
  if digits and not target_list:  # target stacked, saved unrolled
    layers = [saved[str(i)] for i in range(len(saved))]
    return jax.tree.map(lambda *xs: np.stack(xs), *[_relayout(_unstacked(target), layer) for layer in layers])
  if target_list and not digits:  # target unrolled, saved stacked
    return {i: _relayout(target[i], jax.tree.map(lambda x, i=i: x[i], saved)) for i in target}
  return {k: _relayout(target[k], saved[str(k)]) for k in target}


def _unstacked(target: Any) -> Any:
  """Abstract arrays without their leading (layers) axis."""
  return jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], t.dtype), target)


def save_params(path: str, params: Any) -> None:
  """Write a params-only checkpoint usable as load_parameters_path."""
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(path), {"params": params})
  checkpointer.wait_until_finished()
  jax.effects_barrier()
