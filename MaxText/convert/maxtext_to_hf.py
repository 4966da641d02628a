"""MaxText config + params -> a Hugging Face directory (config.json + safetensors shards).

    python3 -m MaxText.convert.maxtext_to_hf CONFIG.yml load_parameters_path=PARAMS --output HF_DIR [--dtype float32]
    # a LoRA fine-tune: adapters merged into the base kernels (docs/lora.md)
    python3 -m MaxText.convert.maxtext_to_hf CONFIG.yml load_parameters_path=BASE lora_rank=R lora_alpha=A \
      lora_weights_path=RUN_DIR/checkpoints/STEP/state --output HF_DIR

PARAMS and HF_DIR may be local or gs:// (docs/cloud_storage.md).

transformers.AutoModelForCausalLM.from_pretrained(HF_DIR) loads the result. One safetensors shard per
decoder layer (plus one for embeddings/head), each read from the checkpoint (MaxText/convert/streaming.py
Reader: tensorstore, one layer block at a time) and written before the next, so host memory stays near
one layer whatever the model's size. The checkpoint may be params-only or a train state, scanned or
not (whichever layout it holds is read; the output is the same). float32 output is bit-exact with
the MaxText parameters (and so HF -> MaxText -> HF is bit-exact for float32 checkpoints).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from MaxText import checkpointing, launch, models, paths
from MaxText import state as state_lib
from MaxText.config import Config, serving_config
from MaxText.convert import hf_mapping, mappings, streaming
from MaxText.errors import ConfigError
from MaxText.layers import lora
from MaxText.layers.model_config import ModelConfig

# Written with numpy (no torch): the same bytes torch's .to(dtype) and safetensors.torch would write (round to
# nearest even), and the "pt" metadata transformers expects.
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def to_hf(kernel: np.ndarray, rule: hf_mapping.Rule) -> np.ndarray:
  """Our parameter slice -> its HF tensor (or rule.cols of it): the inverse of hf_to_maxtext.to_maxtext."""
  kernel = np.asarray(kernel)
  if rule.perm is not None:
    kernel = kernel[..., np.argsort(rule.perm)]
  if rule.stacked:  # ours [E, in, out] -> [E, out, in]
    return np.swapaxes(kernel, -1, -2)
  if rule.n_in is None:
    return kernel.reshape(hf_mapping.hf_shape(rule, kernel.shape))
  matrix = kernel.reshape(int(np.prod(kernel.shape[: rule.n_in])), -1)  # [in, out]
  if rule.conv:
    return matrix.T.reshape(hf_mapping.hf_shape(rule, kernel.shape))
  return matrix.T if rule.transpose else matrix


def join(parts: list[tuple[tuple[int, ...], np.ndarray]], axis: int = -1) -> np.ndarray:
  """The column pieces (slice(*cols), array) of one HF tensor -> the tensor: ranges side by side, or strided
  pieces (cols (j, None, n), gpt-oss's gate/up) interleaved column by column; axis=-2: row pieces (rule.rows)
  one above the other."""
  parts = sorted(parts, key=lambda p: p[0][0])
  if len(parts[0][0]) < 3:
    return np.concatenate([a for _, a in parts], axis=axis)
  stacked = np.stack([a for _, a in parts], axis=-1)  # [..., F, n]
  return stacked.reshape(*stacked.shape[:-2], -1)


def _shard_of(name: str) -> str:
  parts = name.removeprefix(hf_mapping.TEXT_PREFIX).split(".")  # Gemma 3 multimodal: language_model.model.layers
  layer = parts[:2] in (["model", "layers"], ["transformer", "h"])
  return f"layer-{int(parts[2]):05d}" if layer else "other"


def _locate(c: Config, reader: streaming.Reader) -> tuple[Config, tuple[str, ...], dict]:
  """The config in the checkpoint's layer layout (scanned or not), the key prefix of its params
  ('params' in params-only and train-state checkpoints) and the abstract params pure dict."""
  first_missing = None
  for scan in (c.scan_layers, not c.scan_layers):
    layout = c.replace(scan_layers=scan)
    abstract = nnx.to_pure_dict(state_lib.param_spec(layout).abstract)
    wanted = [
      tuple(str(streaming.key_name(k)) for k in key) + ("value",)
      for key, _ in jax.tree_util.tree_leaves_with_path(abstract)
    ]
    for prefix in (("params",), ()):
      missing = [key for key in wanted if prefix + key not in reader.keys]
      if not missing:
        return layout, prefix, abstract
      first_missing = first_missing or missing[0]
  raise ConfigError(
    f"load_parameters_path {reader.path!r} does not hold this model's parameters (no {'/'.join(first_missing)})"
  )


def convert(c: Config, output: str, dtype: str = "float32") -> None:
  """Write OUTPUT/config.json and safetensors shards (one per decoder layer, one for the rest), reading
  and writing one shard at a time: host memory stays near one layer, not the model. Under LoRA
  (lora_rank > 0) the adapters of lora_weights_path are first merged into the base (merge_lora).

  Either path may be gs://: tensorstore reads a remote checkpoint itself; a remote output is written to a
  local staging directory (safetensors writes local files) and then uploaded, so it needs local disk for
  the whole export."""
  if not c.load_parameters_path:
    raise ConfigError("Set load_parameters_path= to the MaxText params to export")
  where = f"load_parameters_path={c.load_parameters_path!r}"
  if not paths.with_timeout(lambda: paths.isdir(c.load_parameters_path), where):
    raise ConfigError(f"load_parameters_path {c.load_parameters_path!r} does not exist")
  with paths.local_output_dir(output, "--output") as local, tempfile.TemporaryDirectory() as scratch:
    _write(merge_lora(c, scratch) if lora.enabled(c) else c, local, dtype)


def merge_lora(c: Config, directory: str) -> Config:
  """LoRA export: the base (load_parameters_path) with the adapters (lora_weights_path) folded into its
  kernels, W + (lora_alpha / lora_rank) * A @ B, written as a params checkpoint under `directory`; returns
  the config that exports it (serving_config, reading those params). Holds the whole model in host memory once."""
  if not c.lora_weights_path:
    raise ConfigError(
      f"lora_rank={c.lora_rank}: set lora_weights_path to the adapters to merge (a LoRA run's "
      "checkpoints/<step>/state), or lora_rank=0 to export the base model alone"
    )
  path = os.path.join(directory, "merged")
  checkpointing.save_params(path, checkpointing.load_lora_merged(c))  # the merge decode.py serves, too
  return serving_config(c).replace(load_parameters_path=path)


def _write(c: Config, output: str, dtype: str) -> None:
  """convert() into the local directory `output`."""
  reader = streaming.Reader(c.load_parameters_path)
  layout, prefix, abstract = _locate(c, reader)
  block_axes = 1 if layout.scan_layers else 0  # a stacked parameter is read one layer at a time
  mapping = mappings.of_block(c.decoder_block)
  by_shard: dict[str, list[hf_mapping.Rule]] = {}
  model = ModelConfig.from_config(layout)
  stacks = models.family(model).stacks(model)
  for rule in mapping.rules(layout, stacks, abstract) + mapping.mtp_copies(c):
    by_shard.setdefault(_shard_of(rule.hf_name), []).append(rule)
  os.makedirs(output, exist_ok=True)
  weight_map = {}
  for i, shard in enumerate(sorted(by_shard)):
    pieces: dict[str, list] = {}  # fused HF tensors (GPT-2's c_attn) come in column (or row) ranges
    axes: dict[str, int] = {}
    for rule in by_shard[shard]:
      key = prefix + tuple(map(str, rule.path)) + ("value",)
      array = to_hf(reader.read(key, rule.index, block_axes if rule.index else 0), rule)
      pieces.setdefault(rule.hf_name, []).append((rule.rows or rule.cols or (0, None), array))
      axes[rule.hf_name] = -2 if rule.rows else -1
    tensors = {}
    for name, parts in pieces.items():
      array = join(parts, axes[name])
      tensors[name] = np.ascontiguousarray(array, np.float32).astype(DTYPES[dtype])
    filename = f"model-{i + 1:05d}-of-{len(by_shard):05d}.safetensors"
    save_file(tensors, os.path.join(output, filename), metadata={"format": "pt"})
    weight_map |= {name: filename for name in tensors}
  with open(os.path.join(output, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(output, "config.json"), "w") as f:
    json.dump(mapping.hf_config(c, dtype), f, indent=1)


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  name, where = "MaxText.convert.maxtext_to_hf", "Hugging Face directory to write"
  output = launch.export_main(argv, name, __doc__, "docs/models.md", where, tuple(DTYPES), convert)
  print(f"Wrote {output}")


if __name__ == "__main__":
  main(sys.argv)
