"""Orbax checkpoints: resume > load_full_state_path > load_parameters_path > fresh init.

Layout: <run dir>/checkpoints/<step>/{state, data}: `state` is the TrainState (params, optimizer,
step; under LoRA the params are the adapters only, docs/lora.md), `data` the input iterator's JSON
state. Orbax writes each step to a temporary directory and renames it when complete, so a crash or kill
mid-save leaves the previous checkpoint intact and the partial one is ignored. Restores go straight into
the sharded layout of the abstract state.

Faults (docs/failures.md): a resume that cannot read the newest step says why in one line, moves that
step aside to <run dir>/checkpoints_unreadable/ (nothing is deleted) and falls back to the next older
one; a save that runs out of disk space removes its partial directory and raises CheckpointError.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from MaxText import checkpoint_layouts, checksums, config_checks, paths, teacher
from MaxText import state as state_lib
from MaxText.config import Config, serving_config
from MaxText.convert import upstream
from MaxText.errors import CheckpointError, ConfigError, DataError
from MaxText.layers import lora
from MaxText.state import StateSpec, TrainState

ITEMS = ("state", "data", "checksums")  # `checksums`: digests of `state` and `data` (checksums.py; none before)
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax names a step directory being written <step>TMP_SUFFIX[...]
UNREADABLE_DIR = "checkpoints_unreadable"  # next to checkpoints/: where unreadable steps are moved
NONFINITE_DIR = "checkpoints_nonfinite"  # next to checkpoints/: steps whose own loss is not finite
NONFINITE_FILE = "nonfinite_loss_steps.json"  # in the run dir: those steps, recorded when the run stopped


class Restored(NamedTuple):
  state: TrainState
  data_state: dict | None  # the iterator state saved with it (resume only)
  source: str  # "resume from step N" | "load_full_state_path" | "load_parameters_path" | "init"


class _NoSpaceTracebacks(logging.Filter):
  """orbax logs a full traceback from each background save thread that hits ENOSPC (asyncio too, for a task
  whose failure nobody awaited); CheckpointError says it in one line, so those records keep their one-line
  message and lose the traceback."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and record.exc_info[1] is not None and _no_space(record.exc_info[1]):
      record.exc_info, record.exc_text = None, None
    return True


_NO_SPACE_FILTER = _NoSpaceTracebacks()


class _NoStepMetadataNotice(logging.Filter):
  """orbax warns "Metadata file does not exist: .../_CHECKPOINT_METADATA" when it reads an item directory
  (`checkpoints/<step>/state`, what load_*_path take): that file belongs to the step directory above, so an
  item directory never has it. Dropped only while such a path is being loaded (functions decorated with
  @_loading_item(), a context manager that also serves as a decorator)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Metadata file does not exist")


@contextlib.contextmanager
def _loading_item() -> Iterator[None]:
  quiet, absl = _NoStepMetadataNotice(), logging.getLogger("absl")
  absl.addFilter(quiet)
  try:
    yield
  finally:
    absl.removeFilter(quiet)


def _quiet_closed_loop_errors(hook=sys.unraisablehook):
  """sys.unraisablehook without asyncio's "Event loop is closed" RuntimeError. When a background save
  fails (disk full), tensorstore completes the other writes' futures after orbax closed their event loop
  and reports each as unraisable (a bare traceback); CheckpointError has already said what happened."""

  def quiet(unraisable):
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
      hook(unraisable)

  quiet.quiets_closed_loops = True
  return quiet


def create_manager(config: Config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    return None
  # orbax logs through absl; a save task that fails after its caller stopped waiting is reported by asyncio's
  # "Task exception was never retrieved" (seen on a loaded host). Adding a filter twice is a no-op.
  for logger in ("absl", "asyncio"):
    logging.getLogger(logger).addFilter(_NO_SPACE_FILTER)
  if not getattr(sys.unraisablehook, "quiets_closed_loops", False):
    sys.unraisablehook = _quiet_closed_loop_errors()
  options = ocp.CheckpointManagerOptions(
    save_interval_steps=1,  # the train loop decides which steps are due (checkpoint_period, last step)
    max_to_keep=None if config.max_num_checkpoints_to_keep == -1 else config.max_num_checkpoints_to_keep,
    enable_async_checkpointing=config.async_checkpointing,
    create=True,
    cleanup_tmp_directories=True,
  )
  return ocp.CheckpointManager(paths.absolute(config.checkpoint_dir), options=options, item_names=ITEMS)


def save(
  manager: ocp.CheckpointManager, step: int, state: TrainState, data_state: dict, metadata: dict | None = None
) -> None:
  """Save `state` after `step` completed steps with the iterator state that follows it, and `metadata` (JSON:
  elastic.layout's) in the step's orbax metadata. With async saves this returns once the arrays are copied to
  host memory; an earlier save's write error surfaces here."""
  # Verified when restored: a flipped bit, or an iterator state that is not the one saved, is damage to fall back from.
  table = checksums.digests(state) | {checksums.DATA_KEY: checksums.json_digest(data_state)}
  args = ocp.args.Composite(
    state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), checksums=ocp.args.JsonSave(table)
  )
  with _save_errors(manager):
    manager.save(step, args=args, force=True, custom_metadata=metadata)


def wait_for_saves(manager: ocp.CheckpointManager) -> None:
  """Block until every dispatched save is committed (its step directory renamed into place)."""
  with _save_errors(manager):
    manager.wait_until_finished()


def finish(manager: ocp.CheckpointManager) -> None:
  """Let in-flight saves complete, then release the manager's threads."""
  try:
    wait_for_saves(manager)
  finally:
    manager.close()


def committed_steps(directory: str) -> list[int]:
  """The steps whose directories are complete (named <step>, not <step>TMP_SUFFIX...), ascending."""
  root = epath.Path(directory)
  if not root.exists():
    return []
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def _set_aside_nonfinite(config: Config, manager: ocp.CheckpointManager) -> None:
  """Move the checkpoints recorded by nonfinite.advice out of the way, once, before resuming."""
  record = epath.Path(config.run_dir) / NONFINITE_FILE
  if not record.exists():
    return
  present = set(committed_steps(str(manager.directory)))
  for step in json.loads(record.read_text()):
    if step in present:
      say(f"checkpoint step {step} gave a non-finite loss; moved it to {move_aside(config, step, NONFINITE_DIR)}")
  if jax.process_count() > 1:  # every process sees the moved directories and the record before it goes
    multihost_utils.sync_global_devices("nonfinite_checkpoints_moved")
  if jax.process_index() == 0:
    record.unlink()
  manager.reload()


def _no_space(error: BaseException) -> bool:
  """Whether `error` (or one it came from) is ENOSPC; tensorstore reports it as a ValueError whose text
  carries the OS error code."""
  seen = error
  while seen is not None:
    if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
      return True
    if "No space left on device" in str(seen) or f"os_error_code='{errno.ENOSPC}'" in str(seen):
      return True
    seen = seen.__cause__ or seen.__context__
  return False


@contextlib.contextmanager
def _save_errors(manager: ocp.CheckpointManager) -> Iterator[None]:
  """Turn a full disk into CheckpointError after removing the partial step directories (the complete
  ones are untouched); other errors pass through unchanged."""
  try:
    yield
  except Exception as e:
    if not _no_space(e):
      raise
    try:  # an async save's other writes may still be in flight: they would land in a directory removed below
      manager.wait_until_finished()
    except Exception:  # noqa: BLE001 (the same full disk, reported again: already being handled)
      pass
    root = epath.Path(manager.directory)
    partial = sorted(p.name for p in root.iterdir() if TMP_SUFFIX in p.name) if root.exists() else []
    if jax.process_index() == 0:  # the directory is shared; one process removes it
      for name in partial:
        shutil.rmtree(root / name, ignore_errors=True)
    steps = committed_steps(str(root))
    last = f"step {steps[-1]} is the last complete checkpoint" if steps else "no checkpoint is complete"
    raise CheckpointError(
      f"no space left on {root} while saving a checkpoint; removed the partial save ({', '.join(partial) or 'none'}); "
      f"{last}. Free space there (or set base_output_directory elsewhere, or lower max_num_checkpoints_to_keep) "
      "and restart with the same run_name to resume."
    ) from e


def restore_or_init(
  config: Config,
  tx: optax.GradientTransformation,
  spec: StateSpec,
  manager: ocp.CheckpointManager | None,
  accept_data: Callable[[Any], None] | None = None,
) -> Restored:
  """The starting state, in order of precedence: this run's latest readable checkpoint, then the load_* paths.
  `accept_data` (the batch source's set_state) takes a resumed step's iterator state: DataError when it does not
  fit this run's data (the user's change: it propagates), any other error when it is malformed (damage).

  When spec.partition freezes parameters (LoRA: the base) checkpoints hold the trainable ones (the adapters)
  and their optimizer state only; the frozen base always comes from load_parameters_path (or, with
  lora_random_base, from init_weights_seed)."""
  if spec.partition.freezes:
    _check_lora_base(config)
  if manager is not None:
    _set_aside_nonfinite(config, manager)
  saved = spec.partition.checkpointed(spec.abstract)  # what a checkpoint of this run holds
  if manager is not None and manager.all_steps():
    restored = _restore_latest_good(config, manager, saved, accept_data)
    state = _with_base(config, tx, spec, restored.state)
    restored = restored._replace(state=with_reference(spec, state, lambda: _starting_params(config, tx, spec, saved)))
    return teacher.attach(spec, restored, load_params)  # objective=distill: its teacher, read again on resume
  return teacher.attach(spec, _start(config, tx, spec, saved), load_params)


def _start(config: Config, tx: optax.GradientTransformation, spec: StateSpec, saved: TrainState) -> Restored:
  """A run's first state: load_full_state_path > load_parameters_path > init (LoRA: _init_lora)."""
  if config.load_full_state_path:
    # The optimizer's initial state around the restored params: what an upstream state does not hold.
    fresh = lambda params: state_lib.state_around(tx, spec, params).opt_state  # noqa: E731
    state = _with_base(config, tx, spec, _restore_tree(config.load_full_state_path, saved, fresh, config))
    return Restored(with_reference(spec, state, lambda: state.params), None, "load_full_state_path")
  if spec.partition.freezes:
    return _init_lora(config, tx, spec)
  if config.load_parameters_path:
    params = load_params(config.load_parameters_path, spec.abstract.params, config)
    state = with_reference(spec, state_lib.state_around(tx, spec, params), lambda: params)
    return Restored(state, None, "load_parameters_path")
  return Restored(state_lib.init_state(config, tx, spec), None, "init")  # dpo, grpo: its reference copies the init


def _starting_params(config: Config, tx: optax.GradientTransformation, spec: StateSpec, saved: TrainState):
  """The params this run started from (those _start gives), read again: the DPO reference of a resumed run."""
  if config.load_full_state_path:
    return _start(config, tx, spec, saved).state.params
  if config.load_parameters_path:
    return load_params(config.load_parameters_path, spec.abstract.params, config)
  params = state_lib.ParamSpec(spec.graphdef, spec.abstract.params, spec.shardings.params, spec.plan, spec.partition)
  return state_lib.init_params(config, params)


def with_reference(spec: StateSpec, state: TrainState, starting_params: Callable[[], nnx.State]) -> TrainState:
  """A reference-keeping objective without LoRA: `state` with its reference, a copy of starting_params() in
  the params' shardings (a copy: the train step donates the state, and one buffer cannot be donated twice).
  Checkpoints do not hold it (Partition.checkpointed), so a resume re-reads the run's starting params: the
  same load_parameters_path, load_full_state_path or init_weights_seed give the same reference."""
  if spec.abstract.reference is None or spec.teacher is not None:
    return state
  copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=spec.shardings.params)
  return state.replace(reference=copy(starting_params()))


def _check_lora_base(config: Config) -> None:
  if not config.load_parameters_path and not config.lora_random_base:
    raise ConfigError(
      f"lora_rank={config.lora_rank} fine-tunes adapters on a base model: set load_parameters_path to its params "
      "(MaxText/convert/hf_to_maxtext.py writes them; docs/lora.md), or lora_random_base=true for a test"
    )


def _base_params(config: Config, tx: optax.GradientTransformation, spec: StateSpec) -> nnx.State:
  """The frozen base parameters: load_parameters_path, or (lora_random_base) those of a fresh init."""
  frozen = spec.partition.split(spec.abstract.params).frozen
  if config.load_parameters_path:
    return load_params(config.load_parameters_path, frozen, config)
  return spec.partition.split(state_lib.init_state(config, tx, spec).params).frozen


def _with_base(config: Config, tx: optax.GradientTransformation, spec: StateSpec, state: TrainState) -> TrainState:
  """A restored checkpoint's state (under LoRA: adapters only) completed with the frozen base."""
  if not spec.partition.freezes:
    return state
  return state.replace(params=spec.partition.combine(state.params, _base_params(config, tx, spec)))


def _init_lora(config: Config, tx: optax.GradientTransformation, spec: StateSpec) -> Restored:
  """A fresh LoRA state: the base, adapters from lora_weights_path or fresh (B = 0: the base's outputs)."""
  abstract = spec.partition.split(spec.abstract.params)
  if config.load_parameters_path:  # no random base made only to be replaced (state.lora_state_around)
    base = load_params(config.load_parameters_path, abstract.frozen, config)
    fresh, source = state_lib.lora_state_around(config, tx, spec, base), "load_parameters_path"
  else:
    fresh, source = state_lib.init_state(config, tx, spec), "init"
  adapters, base = spec.partition.split(fresh.params)
  if config.lora_weights_path:
    adapters = load_params(config.lora_weights_path, abstract.trainable)
    source += " + lora_weights_path"
  return Restored(fresh.replace(params=spec.partition.combine(adapters, base)), None, source)


def load_lora_merged(config: Config, mesh: Mesh | None = None) -> nnx.State:
  """Serving a LoRA fine-tune (lora_rank > 0): the base (load_parameters_path, or with lora_random_base a fresh
  init) with the adapters of lora_weights_path (fresh ones, B = 0, only with lora_random_base) folded into its
  kernels once, W + (lora_alpha / lora_rank) * A @ B. Returns the params of serving_config(config), so
  decoding runs plain matmuls; with a mesh they lie where that model's params are sharded."""
  config_checks.check_lora_serving(config)
  spec = state_lib.param_spec(config, mesh)
  abstract = spec.partition.split(spec.abstract)
  if config.load_parameters_path and config.lora_weights_path:
    base = load_params(config.load_parameters_path, abstract.frozen, config)
    adapters = load_params(config.lora_weights_path, abstract.trainable)
  else:  # lora_random_base: the seed's base (as training drew it) and, when none are given, fresh adapters
    adapters, base = spec.partition.split(state_lib.init_params(config, spec))
    if config.load_parameters_path:
      base = load_params(config.load_parameters_path, abstract.frozen, config)
    if config.lora_weights_path:
      adapters = load_params(config.lora_weights_path, abstract.trainable)
  plain = state_lib.param_spec(serving_config(config), mesh)
  # One program, the base donated: each merged kernel may take its base kernel's buffer (same shape and
  # dtype), so the model is not held twice; out_shardings put it where the plain model keeps it.
  merge = jax.jit(
    lambda b, a: lora.merged(config, spec.partition.combine(a, b)), donate_argnums=0, out_shardings=plain.shardings
  )
  return merge(base, adapters)


def one_line(error: BaseException, limit: int = 300) -> str:
  text = " ".join(f"{type(error).__name__}: {error}".split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def say(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def _restore_latest_good(
  config: Config, manager: ocp.CheckpointManager, abstract: TrainState, accept_data: Callable[[Any], None] | None
) -> Restored:
  """Newest step first. A step that fails to restore (its arrays or iterator state unreadable, not matching their
  checksums, or an iterator state accept_data finds malformed) is named with its reason; once an older step
  restores, the failed newer ones are moved aside so later restarts and saves do not trip on them. When
  no step restores (e.g. the model config changed) nothing is moved and CheckpointError says why."""
  failed: list[tuple[int, str]] = []
  args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore())
  for step in sorted(manager.all_steps(), reverse=True):
    step_dir, what = paths.join(config.checkpoint_dir, str(step)), f"checkpoint step {step}"
    try:
      restored = manager.restore(step, args=args)
      checksums.verify(step_dir, restored.state, what)
      checksums.verify_json(step_dir, restored.data, what)
      if accept_data is not None:
        accept_data(restored.data)
    except DataError:  # an intact iterator state that does not fit this run's data: the user changed it
      raise
    except Exception as e:  # orbax/tensorstore raise ValueError, KeyError, JSONDecodeError, OSError, ...
      failed.append((step, one_line(e)))
      say(f"checkpoint step {step} cannot be restored: {failed[-1][1]}")
      continue
    for bad, _ in failed:
      moved = move_aside(config, bad, UNREADABLE_DIR)
      say(f"moved unreadable checkpoint step {bad} to {moved}; resuming from step {step}")
    if failed:
      if jax.process_count() > 1:  # every process sees the moved directories before anyone saves
        multihost_utils.sync_global_devices("checkpoints_moved_aside")
      manager.reload()
    return Restored(restored.state, restored.data, f"resume from step {step}")
  step, reason = failed[0]
  raise CheckpointError(
    f"no checkpoint under {config.checkpoint_dir} can be restored (newest, step {step}: {reason}). If the model "
    "config changed since they were saved, use a new run_name; if the files are damaged, move the step "
    "directories aside."
  )


def move_aside(config: Config, step: int, where: str) -> str:
  """Rename checkpoints/<step> to <run dir>/<where>/<step>[.N] (writer process); returns the new path."""
  source = epath.Path(config.checkpoint_dir) / str(step)
  aside = epath.Path(config.run_dir) / where
  target, n = aside / str(step), 0
  while target.exists():  # an earlier failure of the same step number is kept too
    n += 1
    target = aside / f"{step}.{n}"
  if jax.process_index() == 0:
    aside.mkdir(parents=True, exist_ok=True)
    source.rename(target)
  return str(target)


def _check_not_step_dir(key: str, path: str) -> None:
  """A step directory (ours: <step>/{state,data}; upstream MaxText's: <step>/items) is not itself an orbax
  PyTree checkpoint: say which one is."""
  root = epath.Path(path)
  for item in ("state", "items"):
    if (root / item).is_dir() and not (root / "_METADATA").exists():
      raise ConfigError(f"{key} {path!r} is a checkpoint step directory; set {key}={root / item}")


@_loading_item()
def _restore_tree(path: str, abstract: Any, fresh: Callable[[nnx.State], Any], config: Config) -> Any:
  path = paths.absolute(path)
  if not paths.with_timeout(lambda: paths.isdir(path), f"load_full_state_path={path!r}"):
    raise ConfigError(f"Checkpoint {path!r} does not exist")
  _check_not_step_dir("load_full_state_path", path)
  tree = saved_tree(path)
  if upstream.layout(tree) is not None:
    return checkpoint_layouts.restore_upstream_state(path, tree, abstract, fresh, config)
  try:
    state = ocp.StandardCheckpointer().restore(path, abstract)
  except (ValueError, KeyError, FileNotFoundError) as e:
    raise ConfigError(f"Checkpoint {path!r} does not match this model's state: {e}") from e
  _verify_item(path, state, "")
  return state


def _verify_item(path: str, tree: Any, prefix: str) -> None:
  """A training checkpoint's `state` item given by path is checked against its step's digests (checksums.py);
  a params-only checkpoint (the converters') has none to check."""
  step_dir = paths.dirname(path)
  if paths.Path(path).name == "state" and paths.isdir(paths.join(step_dir, "data")):
    checksums.verify(step_dir, tree, f"checkpoint {path}", prefix)


@_loading_item()  # the converters read a training checkpoint's tree through here too
def saved_tree(path: str) -> Any:
  """The tree (nested dicts of per-array metadata) of the orbax PyTree checkpoint at `path`. Absolute: orbax reads
  no item metadata under a relative path (it warns "Failed to get item metadata" and returns none)."""
  metadata = ocp.PyTreeCheckpointer().metadata(paths.absolute(path))
  tree = metadata.item_metadata if hasattr(metadata, "item_metadata") else metadata
  if tree is None:  # orbax warns and returns no metadata when its index (ocdbt manifest, _METADATA) is unreadable
    raise CheckpointError(f"checkpoint {path} cannot be read: its array index or metadata is damaged or missing")
  return getattr(tree, "tree", tree)


@_loading_item()
def load_params(path: str, abstract_params: Any, config: Config | None = None) -> Any:
  """Params from `path`: a params-only checkpoint, or a train-state checkpoint's `params` subtree. An upstream
  MaxText checkpoint is mapped by the family of `config` (the run's; convert/upstream.py)."""
  path = paths.absolute(path)
  if not paths.with_timeout(lambda: paths.isdir(path), f"load_parameters_path={path!r}"):
    raise ConfigError(f"load_parameters_path {path!r} does not exist")
  _check_not_step_dir("load_parameters_path", path)
  tree = saved_tree(path)
  if upstream.layout(tree) is not None:
    return checkpoint_layouts.upstream_params(path, tree, abstract_params, config)
  item = {"params": abstract_params} if isinstance(tree, dict) and "params" in tree else abstract_params
  restore_args = ocp.checkpoint_utils.construct_restore_args(item)
  try:
    restored = ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    )
  except (ValueError, KeyError, FileNotFoundError) as e:
    relaid = checkpoint_layouts.restore_other_layout(path, tree, abstract_params)
    if relaid is None:
      raise ConfigError(f"load_parameters_path {path!r} does not match this model's parameters: {e}") from e
    return relaid
  restored = restored["params"] if item is not abstract_params else restored
  _verify_item(path, restored, "params/" if item is not abstract_params else "")
  missing = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(restored) if _is_abstract(v)]
  if missing:  # partial_restore leaves parameters the checkpoint lacks unrestored
    relaid = checkpoint_layouts.restore_other_layout(path, tree, abstract_params)
    if relaid is None:
      raise ConfigError(f"load_parameters_path {path!r} lacks {missing[0]} (and {len(missing) - 1} more)")
    return relaid
  return restored


def _is_abstract(x: Any) -> bool:
  return isinstance(x, jax.ShapeDtypeStruct)


def save_params(path: str, params: Any) -> None:
  """Write a params-only checkpoint usable as load_parameters_path."""
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(paths.absolute(path), {"params": params})
  checkpointer.wait_until_finished()
  jax.effects_barrier()
