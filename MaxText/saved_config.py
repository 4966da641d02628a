"""The config.yml saved next to a checkpoint, compared with this run's config before anything restores it.

train.py writes <run dir>/config.yml; hf_to_maxtext writes OUT/config.yml beside OUT/params. A checkpoint of
another architecture otherwise fails inside orbax, hundreds of lines deep, with advice (strict=False) that
would load it wrongly. Here the differing keys are named, in one line, before any device work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import yaml
from flax import nnx

from MaxText import checkpointing, paths
from MaxText import state as state_lib
from MaxText.config import Config
from MaxText.errors import ConfigError

# Keys that decide the shapes or the structure of the saved state: (key, its base_* key when derived).
SHAPE_KEYS = (
  ("decoder_block", None),
  ("emb_dim", "base_emb_dim"),
  ("num_query_heads", "base_num_query_heads"),
  ("num_kv_heads", "base_num_kv_heads"),
  ("mlp_dim", "base_mlp_dim"),
  ("moe_mlp_dim", "base_moe_mlp_dim"),
  ("num_decoder_layers", "base_num_decoder_layers"),
  ("head_dim", None),
  ("vocab_size", None),
  ("mlp_activations", None),
  ("logits_via_embedding", None),
  ("use_qk_norm", None),
  ("attention_bias", None),
  ("mlp_bias", None),
  ("use_post_attn_norm", None),
  ("use_post_ffw_norm", None),
  ("num_experts", None),
  ("shared_experts", None),
  ("routed_bias", None),
  ("attention_sink", None),
  ("router_bias", None),
  ("first_num_dense_layers", None),
  ("q_lora_rank", None),
  ("kv_lora_rank", None),
  ("qk_nope_head_dim", None),
  ("qk_rope_head_dim", None),
  ("v_head_dim", None),
  ("index_n_heads", None),
  ("index_head_dim", None),
  ("trainable_position_size", None),
)
PARENTS_SEARCHED = 3  # <run dir>/checkpoints/<step>/state: config.yml is three directories up


def read(directory: str) -> dict[str, Any] | None:
  """The mapping in directory/config.yml (local or gs://), or None when there is none (or it is not a mapping).
  StorageError when a gs:// directory has no answer within paths.PROBE_TIMEOUT_S."""
  path = paths.join(directory, "config.yml")

  def text() -> str | None:
    return paths.Path(path).read_text() if paths.isfile(path) else None

  found = paths.probe(path, text, repr(path))
  if found is None:
    return None
  try:
    saved = yaml.safe_load(found)
  except yaml.YAMLError:
    return None  # not ours to judge here; the restore reports what it finds
  return saved if isinstance(saved, dict) else None


def differences(saved: Mapping[str, Any], config: Config, *, layout: bool) -> list[str]:
  """'key: saved -> now' for each SHAPE_KEYS key (and scan_layers, mtp_num_layers and clipping when `layout`, which a
  full-state restore cannot bridge) that differs; keys the saved config lacks are not compared."""
  diffs = []
  for key, base_key in SHAPE_KEYS:
    name = key if key in saved else base_key
    if name is not None and name in saved and saved[name] != config[name]:
      diffs.append(f"{name}: {saved[name]!r} -> {config[name]!r}")
  if layout:
    if "scan_layers" in saved and saved["scan_layers"] != config.scan_layers:
      diffs.append(f"scan_layers: {saved['scan_layers']!r} -> {config.scan_layers!r}")
    # Not in SHAPE_KEYS: a params-only load (decoding) reads a checkpoint with or without MTP modules.
    if saved.get("mtp_num_layers", config.mtp_num_layers) != config.mtp_num_layers:
      diffs.append(f"mtp_num_layers: {saved['mtp_num_layers']!r} -> {config.mtp_num_layers!r}")
    clip = saved.get("gradient_clipping_threshold")
    if clip is not None and (clip > 0) != (config.gradient_clipping_threshold > 0):
      diffs.append(f"gradient_clipping_threshold: {clip!r} -> {config.gradient_clipping_threshold!r} (on/off)")
  return diffs


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """'a/b/0/kernel' -> shape for every array (or array metadata) leaf; orbax's trailing 'value' dropped."""
  flat = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape")):
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    flat["/".join(names[:-1] if names[-1] == "value" else names)] = tuple(leaf.shape)
  return flat


def shape_differences(path: str, config: Config) -> list[str]:
  """'param: saved shape -> this config's shape' for the parameters of the checkpoint at `path` (a
  params-only or a train-state checkpoint); [] when the shapes agree or the trees differ in layout
  (scan_layers, which load_parameters_path bridges, or another structure the restore reports)."""
  try:
    tree = checkpointing.saved_tree(path)
  except Exception:  # not an orbax checkpoint we can read: the restore reports it
    return []
  saved = _shapes(tree.get("params", tree) if isinstance(tree, dict) else tree)
  wanted = _shapes(nnx.to_pure_dict(state_lib.param_spec(config).abstract))
  if set(saved) != set(wanted):
    return []
  return [f"{k}: {saved[k]} -> {wanted[k]}" for k in sorted(wanted) if saved[k] != wanted[k]]


def _latest_step_dir(config: Config) -> str | None:
  path = config.checkpoint_dir
  if not config.enable_checkpointing:
    return None
  steps = paths.probe(path, lambda: checkpointing.committed_steps(path), f"checkpoint_dir={path!r}")
  return paths.join(path, str(steps[-1]), "state") if steps else None


def _config_above(path: str) -> tuple[str, dict[str, Any]] | None:
  directory = paths.absolute(path)
  for _ in range(PARENTS_SEARCHED + 1):
    saved = read(directory)
    if saved is not None:
      return directory, saved
    parent = paths.dirname(directory)
    if parent == directory or parent.rstrip("/").endswith(":"):  # past the filesystem root or the bucket
      return None
    directory = parent
  return None


def _shown(diffs: list[str], most: int = 3) -> str:
  return "; ".join(diffs[:most]) + (f"; and {len(diffs) - most} more" if len(diffs) > most else "")


def check(config: Config) -> None:
  """ConfigError naming the differing keys when this run would restore a checkpoint (its own, to resume, or
  load_full_state_path / load_parameters_path) whose saved config.yml (or, without one, whose parameter
  shapes) say it is of another architecture. Local and gs:// paths alike."""
  latest = _latest_step_dir(config)
  if latest is not None:
    saved = read(config.run_dir)
    diffs = differences(saved, config, layout=True) if saved else shape_differences(latest, config)
    if diffs:
      raise ConfigError(
        f"run_name={config.run_name!r} has checkpoints of another architecture in {config.checkpoint_dir!r} "
        f"({_shown(diffs)}); use a new run_name, or the run's own settings to resume it"
      )
    return
  for key in ("load_full_state_path", "load_parameters_path"):
    path = config[key]
    if not path:
      continue
    found = _config_above(path)
    if found:
      diffs = differences(found[1], config, layout=key == "load_full_state_path")
      where = f"per {paths.join(found[0], 'config.yml')}"
    else:
      diffs, where = shape_differences(path, config), "parameter shapes saved -> wanted"
    if diffs:
      raise ConfigError(
        f"{key}={path!r} holds a model of another architecture ({where}: {_shown(diffs)}); set the architecture keys "
        "(base_emb_dim, base_num_query_heads, base_num_kv_heads, head_dim, base_mlp_dim, vocab_size, ...) or "
        "model_name to the checkpoint's"
      )
