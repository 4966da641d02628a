"""A compiled train step saved to compiled_trainstep_file (by train_compile.py) and loaded by train.py.

The file holds the serialized executable and the program signature it was compiled for (the config
values that shape the program, the mesh and the devices); train.py reads it before it builds any state,
refuses a step compiled for other hardware in one line, and one compiled for another program naming every
difference.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
from jax.sharding import Mesh

from MaxText import paths
from MaxText.config import Config
from MaxText.errors import ConfigError, ListedConfigError

FORMAT_VERSION = 1  # of the compiled_trainstep_file pickle


# Keys that change nothing in the compiled program: where outputs go, how often to log or save, data
# sources (the batch shape is checked through its own keys). Every other key is compared at load.
RUNTIME_KEYS = (
  "run_name", "base_output_directory", "metrics_file", "enable_tensorboard", "log_period", "log_config",
  "hardware", "steps", "enable_checkpointing", "async_checkpointing", "checkpoint_period",
  "async_checkpoint_max_lag_steps", "lora_weights_path", "lora_random_base",
  "max_num_checkpoints_to_keep", "load_parameters_path", "load_full_state_path", "dataset_type", "dataset_path",
  "text_max_documents", "eval_fraction", "data_shuffle_seed", "tokenizer_path", "add_bos", "add_eos", "packing",
  "eval_interval", "eval_steps", "eval_per_device_batch_size", "profiler", "skip_first_n_steps_for_profiler",
  "profiler_steps", "collect_stack_trace", "stack_trace_to_cloud", "stack_trace_interval_seconds",
  "compile_topology", "compile_topology_num_slices", "compiled_trainstep_file", "init_weights_seed",
  "jax_distributed_initialization_timeout", "jax_distributed_heartbeat_timeout", "nan_check", "run_dir",
  "check_memory_fit",
  "checkpoint_dir", "tensorboard_dir", "tokenizer_dir", "dump_hlo", "dump_hlo_local_dir", "dump_hlo_gcs_dir",
  "dump_hlo_module_name", "dump_hlo_xla_flags",
)  # fmt: skip


def program_signature(config: Config, mesh: Mesh) -> dict[str, Any]:
  """What a compiled step depends on: program-relevant config values, the mesh and the devices. `target` (the
  compile_topology it was compiled for) only words the hardware mismatch; it is not compared."""
  keys = {k: v for k, v in config.to_dict().items() if k not in RUNTIME_KEYS}
  device = mesh.devices.flat[0]
  return {
    "config": keys, "mesh": dict(mesh.shape), "num_devices": mesh.size, "device_kind": device.device_kind,
    "target": config.compile_topology,
  }  # fmt: skip


def save_compiled(path: str, compiled: Any, config: Config, mesh: Mesh) -> None:
  from jax.experimental import serialize_executable  # lazy: only this feature needs it

  executable, in_tree, out_tree = serialize_executable.serialize(compiled)
  payload = {
    "format": FORMAT_VERSION,
    "jax": jax.__version__,
    "signature": program_signature(config, mesh),
    "executable": executable,
    "in_tree": in_tree,
    "out_tree": out_tree,
  }
  paths.makedirs(paths.dirname(paths.absolute(path)))
  paths.Path(path).write_bytes(pickle.dumps(payload))


def _other_hardware(path: str, saved: dict[str, Any], current: dict[str, Any]) -> str | None:
  """One line when the step was compiled for other devices (kind or count) than this run's."""
  if (saved["device_kind"], saved["num_devices"]) == (current["device_kind"], current["num_devices"]):
    return None
  target = f" (compile_topology={saved['target']})" if saved.get("target") not in (None, "", "cpu") else ""
  local = " compile_topology=cpu" if current["device_kind"] == "cpu" else ""
  return (
    f"compiled_trainstep_file={path!r} was compiled for {saved['num_devices']} x {saved['device_kind']}{target}, "
    f"but this run has {current['num_devices']} x {current['device_kind']}: run it on that hardware, or compile "
    f"for these devices with train_compile.py{local}"
  )


def _mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  found = []
  if saved["mesh"] != current["mesh"]:
    found.append(f"mesh: compiled for {saved['mesh']}, this run has {current['mesh']}")
  for key in sorted(set(saved["config"]) | set(current["config"])):
    old, new = saved["config"].get(key, "<absent>"), current["config"].get(key, "<absent>")
    if old != new:
      found.append(f"{key}: compiled with {old!r}, this run has {new!r}")
  return found


def read_checked(config: Config, mesh: Mesh) -> dict[str, Any]:
  """The contents of compiled_trainstep_file, checked against this run before anything is built for it: a
  ConfigError in one line when the file is missing, from another jax or for other hardware; a
  ListedConfigError naming every differing setting (one per line) when it was compiled for another program."""
  path = config.compiled_trainstep_file
  if not paths.with_timeout(lambda: paths.isfile(path), f"compiled_trainstep_file={path!r}"):
    raise ConfigError(f"compiled_trainstep_file={path!r} does not exist; write it with train_compile.py")
  payload = pickle.loads(paths.Path(path).read_bytes())
  if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
    raise ConfigError(f"compiled_trainstep_file={path!r} was not written by this version of train_compile.py")
  if payload["jax"] != jax.__version__:
    raise ConfigError(f"{path!r} was compiled with jax {payload['jax']}, this is jax {jax.__version__}; recompile")
  current = program_signature(config, mesh)
  hardware = _other_hardware(path, payload["signature"], current)
  if hardware:
    raise ConfigError(hardware)
  wrong = _mismatches(payload["signature"], current)
  if wrong:
    raise ListedConfigError(
      f"compiled_trainstep_file={path!r} does not match this run in {len(wrong)} settings; recompile with "
      "train_compile.py or use the compiled settings:\n  " + "\n  ".join(wrong)
    )
  return payload


def load_compiled(payload: dict[str, Any]) -> Any:
  """The train step of a read_checked payload, called like jit_train_step's (state, batch, rng)."""
  from jax.experimental import serialize_executable

  return serialize_executable.deserialize_and_load(payload["executable"], payload["in_tree"], payload["out_tree"])
