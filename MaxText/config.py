"""Configuration: base.yml (+ `base_config:` inheritance) + model preset + key=value + M_<KEY>.

The result is a frozen `Config` passed explicitly to every function; loading it has no side effects
(no directories made, no JAX calls). Every key is declared in configs/base.yml; anything else is an
error with a did-you-mean suggestion.
"""

from __future__ import annotations

import datetime
import difflib
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from MaxText import config_checks
from MaxText.errors import ConfigError
from MaxText.layers import model_config
from MaxText.parallel import kernels, remat

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")  # <family>/presets/<name>.yml
ENV_PREFIX = "M_"

# Keys whose value must be one of a fixed set; checked at load.
# dataset_type -> the module whose make_iterators(config, mesh) reads it (data.make_iterators imports it when
# used, so each backend's libraries load only for its runs). The one list of the dataset types.
DATASET_BACKENDS = {
  "synthetic": "MaxText.data.synthetic",
  "text": "MaxText.data.text",
  "grain": "MaxText.data.grain_data",
  "tfds": "MaxText.data.tfds_data",
  "hf": "MaxText.data.hf_data",
}
CHOICES = {
  **model_config.CHOICES,  # the model keys' Literal types
  "attention": kernels.KINDS,
  "quantization": ("", "int8", "fp8", "int8w"),
  "kv_quant_dtype": ("int8", "fp8"),
  "remat_policy": remat.NAMES,
  "dataset_type": tuple(DATASET_BACKENDS),
  "tokenizer_type": ("sentencepiece", "tiktoken", "huggingface"),
  "grain_file_type": ("arrayrecord", "parquet"),
  "hardware": ("auto", "cpu", "gpu", "tpu"),
  "profiler": ("", "xplane"),
  "decode_sampling_strategy": ("greedy", "weighted", "nucleus", "topk", "composite"),
  "opt_type": ("adamw", "adam_pax", "sgd", "adafactor", "muon"),  # optimizers.OPTIMIZERS
  "auto_fit_objective": ("tokens_per_step", "tokens_per_second"),  # autofit.rank
  "dpo_loss": ("sigmoid", "ipo"),  # objectives/dpo.py
  "distill_loss": ("forward_kl", "reverse_kl", "mix"),  # objectives/distill.py
  "objective": ("lm", "dpo", "grpo", "distill"),  # objectives.REGISTRY
}
CHOICES["objective"] += ("simpo", "orpo")  # objectives/simpo.py, objectives/orpo.py

# Keys derived at load time; users may not set them.
DERIVED = (
  "emb_dim",
  "num_query_heads",
  "num_kv_heads",
  "mlp_dim",
  "moe_mlp_dim",
  "num_decoder_layers",
  "run_dir",
  "checkpoint_dir",
  "tensorboard_dir",
  "tokenizer_dir",
  "learning_rate_schedule_steps_resolved",
)


class Config:
  """Immutable attribute access to the resolved configuration."""

  __slots__ = ("_values",)

  def __init__(self, values: Mapping[str, Any]):
    object.__setattr__(self, "_values", dict(values))

  def __getattr__(self, key: str) -> Any:
    try:
      return self._values[key]
    except KeyError:
      raise AttributeError(f"Config has no key {key!r}{_suggest(key, self._values)}") from None

  def __setattr__(self, key: str, value: Any) -> None:
    raise AttributeError("Config is frozen; use Config.replace(**changes) for a modified copy")

  def __getitem__(self, key: str) -> Any:
    return self.__getattr__(key)

  def __contains__(self, key: str) -> bool:
    return key in self._values

  def __reduce__(self):
    return (Config, (self._values,))

  def to_dict(self) -> dict[str, Any]:
    return dict(self._values)

  def replace(self, **changes: Any) -> Config:
    """A copy with `changes` applied (keys must exist); derived values are recomputed."""
    raw = {k: v for k, v in self._values.items() if k not in DERIVED}
    for key, value in changes.items():
      if key not in raw:
        raise ConfigError(f"Unknown config key {key!r}{_suggest(key, raw)}")
      raw[key] = value
    return Config(_finalize(raw))

  def __repr__(self) -> str:
    return "\n".join(f"{k}: {v!r}" for k, v in sorted(self._values.items()))


def serving_config(config: Config) -> Config:
  """The config a LoRA fine-tune is served, decoded, scored and exported with once its adapters are merged into
  the base kernels (checkpointing.load_lora_merged): the plain model, lora_rank=0 and no lora_weights_path, every
  other key as in `config`."""
  return config.replace(lora_rank=0, lora_weights_path="")


def _suggest(key: str, known: Mapping[str, Any] | Sequence[str]) -> str:
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _is_file(path: str) -> bool:
  """Whether the config file `path` exists; a gs:// one (a config saved with a run or a conversion in a bucket)
  is probed within paths.PROBE_TIMEOUT_S."""
  from MaxText import paths  # noqa: PLC0415 (etils: not needed by --help)

  return paths.probe_isfile(path, f"Config file {path!r}")


def _read_yaml(path: str) -> dict[str, Any]:
  """Read a YAML file (local or gs://), following `base_config:` (relative to the file, then to configs/)."""
  from MaxText import paths  # noqa: PLC0415

  if not _is_file(path):
    raise ConfigError(f"Config file {path!r} does not exist")
  values = yaml.safe_load(paths.Path(path).read_text()) or {}
  if not isinstance(values, dict):
    raise ConfigError(f"Config file {path!r} must hold a mapping of key: value")
  parent = values.pop("base_config", None)
  if parent is None:
    return values
  for candidate in (paths.join(paths.dirname(path), parent), os.path.join(CONFIG_DIR, parent)):
    if _is_file(candidate):
      return {**_read_yaml(candidate), **values}
  raise ConfigError(f"{path!r}: base_config {parent!r} not found next to it or in {CONFIG_DIR}")


def _coerce(key: str, value: Any, default: Any) -> Any:
  """Parse `value` (a string from argv/env, or a YAML value) to the type of `default`."""
  if isinstance(value, str) and not isinstance(default, str):
    try:
      value = yaml.safe_load(value)
    except yaml.YAMLError as e:
      raise ConfigError(f"{key}={value!r} is not valid YAML: {e}") from None
  if isinstance(default, bool):
    if not isinstance(value, bool):
      raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value
  if isinstance(default, int):
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key} must be an integer, got {value!r}")
    return value
  if isinstance(default, float):
    if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
      try:
        value = float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)
  if isinstance(default, str):
    return "" if value is None else str(value)
  if isinstance(default, list):
    if not isinstance(value, list):
      raise ConfigError(f"{key} must be a list, got {value!r}")
    return value
  return value


def _parse_overrides(argv: Sequence[str]) -> dict[str, str]:
  overrides = {}
  for arg in argv:
    if "=" not in arg:
      raise ConfigError(f"Command-line argument {arg!r} is not of the form key=value")
    key, value = arg.split("=", 1)
    overrides[key.strip()] = value
  return overrides


def _apply(values: dict[str, Any], updates: Mapping[str, Any], defaults: Mapping[str, Any], where: str):
  for key, value in updates.items():
    if key in DERIVED:
      raise ConfigError(f"{key} is derived ({where}); set its base_* key or global_parameter_scale")
    if key not in defaults:
      raise ConfigError(f"Unknown config key {key!r} ({where}){_suggest(key, defaults)}")
    values[key] = _coerce(key, value, defaults[key])


def recipes() -> list[str]:
  """The named experiments: every YAML under configs/ except base.yml, by name (its path under configs/ without
  .yml, e.g. "quickstart", "v5e/16b"). The model presets live with their families (presets())."""
  names = []
  for root, _, files in os.walk(CONFIG_DIR):
    rel = os.path.relpath(root, CONFIG_DIR)
    for f in files:
      if f.endswith(".yml") and f != "base.yml":
        names.append(os.path.normpath(os.path.join(rel, f[:-4])).replace(os.sep, "/"))
  return sorted(names)


def resolve_config_path(name: str) -> str:
  """A config file path as given, or a recipe name resolved in configs/ ("v5e/16b" ->
  configs/v5e/16b.yml), so `train.py quickstart` works from any directory."""
  if _is_file(name):
    return name
  for candidate in (os.path.join(CONFIG_DIR, name), os.path.join(CONFIG_DIR, f"{name}.yml")):
    if os.path.isfile(candidate):
      return candidate
  raise ConfigError(
    f"Config file {name!r} does not exist and is not a recipe name{_suggest(name, recipes())}; "
    f"give a path to a .yml file or one of: {', '.join(recipes())}"
  )


def load(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Config:
  """Build the Config from `argv = [config.yml or recipe name, key=value, ...]` and `M_<KEY>` variables."""
  if not argv or "=" in argv[0]:
    raise ConfigError(
      "the first argument must be a config file or a recipe name (e.g. MaxText/configs/base.yml or quickstart), "
      "then key=value overrides"
    )
  environ = os.environ if environ is None else environ
  defaults = _read_yaml(os.path.join(CONFIG_DIR, "base.yml"))
  values = dict(defaults)
  path = resolve_config_path(argv[0])
  from_file = _read_yaml(path)
  saved_run = _drop_derived(from_file)
  _apply(values, from_file, defaults, path)

  cli = _parse_overrides(argv[1:])
  env = {k[len(ENV_PREFIX) :].lower(): v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
  env = {k: v for k, v in env.items() if k in defaults or k in DERIVED}  # M_ is a common prefix
  user = {**cli, **env}
  model_name = _coerce("model_name", user.get("model_name", values["model_name"]), "")
  override = _coerce("override_model_config", user.get("override_model_config", values["override_model_config"]), False)
  preset_file = preset_path(model_name)
  preset = _read_yaml(preset_file)
  if not (saved_run and model_name == values["model_name"]):  # a saved run's file holds its preset's keys as run
    _apply(values, preset, defaults, os.path.relpath(preset_file, os.path.dirname(MODELS_DIR)))
  before = dict(values)
  _apply(values, cli, defaults, "command line")
  _apply(values, env, defaults, "environment")
  if not override:
    clashes = [k for k in preset if values[k] != before[k]]
    if clashes:
      raise ConfigError(
        f"{', '.join(clashes)} set by model preset {model_name!r} and overridden; "
        "pass override_model_config=true to allow it"
      )
  return Config(_finalize(values))


def _drop_derived(values: dict[str, Any]) -> bool:
  """Whether `values` (a config file's keys) is a run's saved config.yml, which holds every resolved key (train.py
  writes it): then its derived keys are dropped, to be recomputed from the keys they derive from, and a
  metrics_file that was its run directory's default is reset, so that run_name=... or base_output_directory=...
  on the command line moves it with the run."""
  derived = [key for key in DERIVED if key in values]
  if not derived:
    return False
  from MaxText import paths  # noqa: PLC0415 (etils: not needed by --help)

  run_dir = values.get("run_dir")
  for key in derived:
    del values[key]
  if run_dir and values.get("metrics_file") == paths.join(str(run_dir), "metrics.jsonl"):
    values["metrics_file"] = ""
  return True


def presets() -> dict[str, str]:
  """model_name -> its preset file: every models/<family>/presets/<model_name>.yml (architecture keys only)."""
  found = {}
  for family in sorted(os.listdir(MODELS_DIR)):
    folder = os.path.join(MODELS_DIR, family, "presets")
    if os.path.isdir(folder):
      found |= {f[:-4]: os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".yml")}
  return found


def preset_path(model_name: str) -> str:
  """The preset file of `model_name`; ConfigError with a did-you-mean and the list when there is none."""
  found = presets()
  if model_name not in found:
    names = sorted(found)
    raise ConfigError(f"Unknown model_name {model_name!r}{_suggest(model_name, names)}; presets: {', '.join(names)}")
  return found[model_name]


def individual_scales(scale: int) -> tuple[int, int, int, int]:
  """log2 multipliers (emb, heads, mlp, layers) for global_parameter_scale, cycling heads/mlp, emb, layers."""
  log2 = int(math.log2(scale)) if scale > 0 else -1
  if scale <= 0 or 2**log2 != scale:
    raise ConfigError(f"global_parameter_scale must be a power of 2, got {scale}")
  base, rem = divmod(log2, 3)
  heads = base + int(rem > 0)
  return base + int(rem > 1), heads, heads, base


def _objective_alias(values: dict[str, Any]) -> dict[str, Any]:
  """use_dpo=true, the older key, is objective=dpo: the one place it is read."""
  if not values["use_dpo"] or values["objective"] == "dpo":
    return values
  if values["objective"] != "lm":
    raise ConfigError(f"use_dpo=true (an alias of objective=dpo) and objective={values['objective']}: set one of them")
  return {**values, "objective": "dpo"}


def _finalize(values: dict[str, Any]) -> dict[str, Any]:
  """Validate and add derived values. Deterministic except for an empty run_name, which becomes the
  load time; reads no files and changes nothing outside the returned dict."""
  for key, choices in CHOICES.items():
    config_checks.check_choice(key, values[key], choices)
  values = _objective_alias(values)
  emb, heads, mlp, layers = individual_scales(values["global_parameter_scale"])
  out = dict(values)
  out["emb_dim"] = values["base_emb_dim"] * 2**emb
  out["num_query_heads"] = values["base_num_query_heads"] * 2**heads
  out["num_kv_heads"] = values["base_num_kv_heads"] * 2**heads
  out["mlp_dim"] = values["base_mlp_dim"] * 2**mlp
  out["moe_mlp_dim"] = (values["base_moe_mlp_dim"] or values["base_mlp_dim"]) * 2**mlp  # routed expert width
  out["num_decoder_layers"] = values["base_num_decoder_layers"] * 2**layers
  if not out["run_name"]:
    out["run_name"] = datetime.datetime.now().strftime("run_%Y%m%d_%H%M%S")
  from MaxText import paths  # noqa: PLC0415 (etils: not needed by --help and config errors)

  out["run_dir"] = paths.join(values["base_output_directory"], out["run_name"])  # local or gs://
  out["checkpoint_dir"] = paths.join(out["run_dir"], "checkpoints")
  out["tensorboard_dir"] = paths.join(out["run_dir"], "tensorboard")
  out["tokenizer_dir"] = paths.join(out["run_dir"], "tokenizer")
  if not values["metrics_file"]:
    out["metrics_file"] = paths.join(out["run_dir"], "metrics.jsonl")
  sched = values["learning_rate_schedule_steps"]
  out["learning_rate_schedule_steps_resolved"] = values["steps"] if sched == -1 else sched
  config_checks.validate(out)
  return out
