"""Hugging Face directory (config.json + *.safetensors) -> MaxText `DIR/params` + `DIR/config.yml`.

    python3 -m MaxText.convert.hf_to_maxtext --hf_path HF_DIR --output OUT_DIR [--scan_layers false] [--dtype bfloat16]

Streams tensor by tensor: every tensor's presence and shape is checked from the safetensors headers
first; then orbax writes the checkpoint through MaxText/convert/streaming.py, which reads one HF tensor,
transforms it and writes it as one chunk (a layer, or one expert of a layer) of its parameter, so peak
host memory stays near the largest such tensor, not the model (a 405B conversion fits one host).
FP8 block-scaled checkpoints (DeepSeek V3's) are dequantized tensor by tensor (MaxText/convert/fp8.py), and
so are gpt-oss's MXFP4 experts (MaxText/convert/mxfp4.py). Which tensor goes where is the family's mapping
(MaxText/models/<family>/hf.py), found by config.json's model_type.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from MaxText import config as config_lib
from MaxText import launch, models, paths
from MaxText import state as state_lib
from MaxText.config import Config
from MaxText.convert import fp8, hf_mapping, mappings, mxfp4, streaming
from MaxText.errors import ConfigError, StorageError
from MaxText.layers.model_config import ModelConfig

log = logging.getLogger(__name__)


def get(tree: dict, path: tuple) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def to_maxtext(tensor: np.ndarray, shape: tuple[int, ...], rule: hf_mapping.Rule) -> np.ndarray:
  """An HF tensor (already cut to rule.cols / rule.rows) -> our layout with `shape`: a torch Linear weight [out, in]
  is transposed, then reshaped; then rule.perm, if any, reorders the last axis."""
  if rule.conv:  # [out, in dims...] -> [out, in]
    tensor = tensor.reshape(tensor.shape[0], -1)
  if rule.stacked:  # [E, out, in] -> [E, in, out]
    tensor = np.swapaxes(tensor, -1, -2)
  out = (tensor.T if rule.n_in is not None and rule.transpose else tensor).reshape(shape)
  return out if rule.perm is None else out[..., rule.perm]


# Copied next to OUTPUT/config.yml when present: what tokenizer_type=huggingface and use_sft read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def read_hf_config(hf_path: str) -> dict[str, Any]:
  """hf_path/config.json as a dict; ConfigError naming the directory, file or field that is wrong."""
  if not os.path.isdir(hf_path):
    raise ConfigError(f"--hf_path {hf_path!r} is not a directory; pass a Hugging Face model directory")
  path = os.path.join(hf_path, "config.json")
  if not os.path.isfile(path):
    raise ConfigError(f"{path!r} does not exist; --hf_path must hold a Hugging Face config.json and *.safetensors")
  try:
    with open(path, encoding="utf-8") as f:
      hf = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(f"{path!r} is not valid JSON: {e}") from None
  if not isinstance(hf, dict):
    raise ConfigError(f"{path!r} must hold a JSON object, got {type(hf).__name__}")
  fields = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf  # multimodal: its text model
  missing = [k for k in mappings.of_config_json(hf).required_fields if k not in fields]
  if missing:
    raise ConfigError(f"{path!r} lacks {', '.join(missing)}; it must describe the checkpoint's architecture")
  return hf


def tensor_index(hf_path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
  """HF tensor name -> (the safetensors file holding it, its shape), from the files' headers."""
  files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
  if not files:
    raise ConfigError(f"No *.safetensors files in {hf_path!r}")
  from safetensors import safe_open  # noqa: PLC0415 (optional dependency of the converters)

  index = {}
  for path in files:
    try:
      with safe_open(path, "np") as f:
        index.update({name: (path, tuple(f.get_slice(name).get_shape())) for name in f.keys()})
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
      raise ConfigError(
        f"{path!r} is not a readable safetensors file ({type(e).__name__}: {e}); re-download it"
      ) from None
  return index


def load_config(hf_path: str, output: str, scan_layers: bool, final: str = "") -> tuple[Config, dict[str, Any]]:
  """OUTPUT/config.yml written and loaded; `final`: where OUTPUT ends up (its tokenizer_path points there).
  DeepSeek's multi-token-prediction modules, when the tensors hold them, set mtp_num_layers."""
  hf = read_hf_config(hf_path)
  mapping = mappings.of_config_json(hf)
  try:
    keys = mapping.maxtext_keys(hf)
  except KeyError as e:
    raise ConfigError(f"{os.path.join(hf_path, 'config.json')!r} lacks the field {e.args[0]!r}") from None
  cfg_path = os.path.join(output, "config.yml")
  try:
    os.makedirs(output, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--output {output!r} cannot be created: {e.strerror}; choose a writable directory") from None
  # Not in maxtext_keys: MTP trains only, and the presets those keys match describe the decoding model.
  mtp_layers = mapping.mtp_layers(hf, tensor_index(hf_path)) if hf.get("num_nextn_predict_layers") else 0
  if mtp_layers:
    keys = {**keys, "mtp_num_layers": mtp_layers}
  if os.path.exists(os.path.join(hf_path, "tokenizer.json")):  # decode.py then needs no tokenizer flags
    tokenizer = paths.join(paths.absolute(final or output), "tokenizer.json")
    for name in TOKENIZER_FILES:  # the config beside tokenizer.json names BOS/EOS and holds the chat template
      if os.path.exists(os.path.join(hf_path, name)):
        shutil.copyfile(os.path.join(hf_path, name), os.path.join(output, name))
    keys = {**keys, "tokenizer_type": "huggingface", "tokenizer_path": tokenizer}
  with open(cfg_path, "w") as f:
    f.write("# Converted from a Hugging Face checkpoint by MaxText.convert.hf_to_maxtext.\n")
    f.write("base_config: base.yml\n")
    yaml.safe_dump({**keys, "scan_layers": scan_layers}, f, sort_keys=False)
  return config_lib.load([cfg_path, "run_name=convert", "dtype=float32"], {}), keys


def convert(hf_path: str, output: str, scan_layers: bool = True, dtype: str = "float32") -> str:
  """Write OUTPUT/config.yml and OUTPUT/params; returns the params path. Every tensor's presence and
  shape is checked (from the safetensors headers) before anything is written. `dtype` is the storage
  dtype of the checkpoint (bfloat16 halves its size; restores cast to the run's weight_dtype).

  Either path may be gs://: a remote hf_path is fetched to a local copy (safetensors reads local files),
  a remote output is written to a local staging directory and then uploaded."""
  if not paths.probe_isdir(hf_path, f"--hf_path {hf_path!r}"):
    raise ConfigError(f"--hf_path {hf_path!r} is not a directory; pass a Hugging Face model directory")
  hf_path = paths.local_copy(hf_path)
  with paths.local_output_dir(output, "--output", replace=("params",)) as local:
    _convert(hf_path, local, scan_layers, dtype, final=output)
  return paths.join(output, "params")


def _convert(hf_path: str, output: str, scan_layers: bool, dtype: str, final: str = "") -> str:
  c, _ = load_config(hf_path, output, scan_layers, final)
  state = state_lib.param_spec(c).abstract
  abstract = nnx.to_pure_dict(state)
  model = ModelConfig.from_config(c)
  mapping = mappings.of_block(c.decoder_block)
  rules = mapping.rules(c, models.family(model).stacks(model), abstract)
  raw, packed = mxfp4.unpack_index(tensor_index(hf_path))  # MXFP4 blocks+scales pairs as one tensor

  def canonical(name: str) -> str:  # multimodal checkpoints name tensors variously; a text-only import reads
    name = hf_mapping.canonical_name(name)  # an image-text checkpoint's text model as the text model's own names
    return name if c.use_multimodal else name.removeprefix(hf_mapping.TEXT_PREFIX)

  real = {canonical(name): name for name in raw}
  index = {canonical(name): v for name, v in raw.items()}
  packed = {canonical(name) for name in packed}
  block = fp8.block_size(read_hf_config(hf_path))
  index = without_towers(mapping, c, index)
  expected = {r.hf_name for r in rules}
  if block:  # each FP8 weight's block scales travel with it
    expected |= {r.hf_name + fp8.SCALE_SUFFIX for r in rules if r.hf_name + fp8.SCALE_SUFFIX in index}
  unexpected = sorted(name for name in set(index) - expected if not mapping.ignored(c, name))
  if unexpected:
    raise ConfigError(f"Tensor {unexpected[0]} (and {len(unexpected) - 1} more) does not fit config.json's model")
  storage = np.dtype(jnp.dtype(dtype))
  slices: dict[tuple, list] = {}
  for rule in rules:
    shape = get(abstract, rule.path).shape[len(rule.index) :]
    _check_shape(index, rule, shape)
    scale = rule.hf_name + fp8.SCALE_SUFFIX
    scale = (index[scale][0], scale) if block and scale in index else None
    read = rule._replace(hf_name=real[rule.hf_name])
    load = functools.partial(_load, index[rule.hf_name][0], read, shape, storage, scale, block, rule.hf_name in packed)
    slices.setdefault(rule.path, []).append((rule.index, load))
  leaves = jax.tree_util.tree_leaves_with_path(abstract)
  unmapped = [jax.tree_util.keystr(k) for k, _ in leaves if tuple(streaming.key_name(p) for p in k) not in slices]
  if unmapped:
    raise ConfigError(f"No Hugging Face tensor maps to parameter {unmapped[0]} (and {len(unmapped) - 1} more)")
  streamed = {
    path: streaming.StreamedArray(tuple(get(abstract, path).shape), storage, tuple(s)) for path, s in slices.items()
  }
  incomplete = [path for path, a in streamed.items() if a.uncovered()]
  if incomplete:
    raise ConfigError(f"Hugging Face tensors cover only part of parameter {'/'.join(map(str, incomplete[0]))}")
  path = os.path.join(output, "params")
  if os.path.exists(path):
    shutil.rmtree(path)
  streaming.save(path, {"params": _fill(state, streamed)})
  return path


def without_towers(mapping: hf_mapping.Mapping, c: Config, index: dict[str, Any]) -> dict[str, Any]:
  """`index` less the image/audio towers' tensors (mapping.towers) that a text-only import skips, saying so in
  one info line."""
  if c.use_multimodal or not mapping.towers:
    return index
  towers = {name for name in index if name.startswith(mapping.towers)}
  if towers:
    found = ", ".join(p + "*" for p in mapping.towers if any(name.startswith(p) for name in towers))
    log.info("Skipping %d tensors of the towers %s: the text model is imported alone", len(towers), found)
  return {name: v for name, v in index.items() if name not in towers}


def _check_shape(index: dict[str, tuple[str, tuple[int, ...]]], rule: hf_mapping.Rule, shape: tuple[int, ...]) -> None:
  """The rule's tensor exists and has the shape our parameter slice implies (from tensor_index)."""
  if rule.hf_name not in index:
    raise ConfigError(f"Missing tensor {rule.hf_name} (needed for {'/'.join(map(str, rule.path))})")
  got = index[rule.hf_name][1]
  if rule.cols:
    got = (*got[:-1], len(range(got[-1])[slice(*rule.cols)]))
  if rule.rows:
    got = (*got[:-2], len(range(got[-2])[slice(*rule.rows)]), got[-1])
  expected = hf_mapping.hf_shape(rule, shape)
  if got != expected:
    raise ConfigError(f"Tensor {rule.hf_name} has shape {got}; config.json implies {expected}")


def _load(
  file: str, rule: hf_mapping.Rule, shape: tuple[int, ...], dtype: np.dtype, scale=None, block=None,
  packed: bool = False,
) -> np.ndarray:  # fmt: skip
  """Read one HF tensor (dequantized with its FP8 `scale` (file, name) and `block`, or from its MXFP4
  blocks and scales when `packed`) in our layout: one slice of its parameter."""
  tensor = mxfp4.read(file, rule.hf_name) if packed else fp8.read_weight(file, rule.hf_name, scale, block)
  if rule.cols:
    tensor = tensor[..., slice(*rule.cols)]
  if rule.rows:
    tensor = tensor[..., slice(*rule.rows), :]
  return to_maxtext(tensor, shape, rule).astype(dtype)


def _fill(state: nnx.State, leaves: dict[tuple, Any]) -> nnx.State:
  """`state` (the model's abstract Params) holding `leaves` (path in its pure dict -> value)."""
  pure = nnx.to_pure_dict(state)
  for path, leaf in leaves.items():
    get(pure, path[:-1])[path[-1]] = leaf
  nnx.replace_by_pure_dict(state, pure)
  return state


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  parser = argparse.ArgumentParser(
    prog="python3 -m MaxText.convert.hf_to_maxtext",
    epilog="More: docs/models.md in the repository.",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--hf_path", required=True, help="directory with config.json and *.safetensors")
  parser.add_argument("--output", required=True, help="writes OUTPUT/params and OUTPUT/config.yml")
  parser.add_argument("--scan_layers", default="true", choices=("true", "false"), help="layout of the layers")
  parser.add_argument(
    "--dtype", default="float32", choices=("float32", "bfloat16"), help="storage dtype (bfloat16: half the disk)"
  )
  args = parser.parse_args(argv[1:])
  jax.config.update("jax_platforms", "cpu")
  launch.setup_logging()
  try:
    path = convert(args.hf_path, args.output, args.scan_layers == "true", args.dtype)
  except ConfigError as e:
    sys.exit(launch.one_line("Conversion error", e))
  except StorageError as e:
    sys.exit(launch.one_line("Storage error", e))
  print(f"Wrote {path} and {paths.join(args.output, 'config.yml')}")


if __name__ == "__main__":
  main(sys.argv)
