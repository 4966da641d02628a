"""MaxText config + params -> a Hugging Face directory (config.json + safetensors shards).

    python3 -m MaxText.convert.maxtext_to_hf CONFIG.yml load_parameters_path=PARAMS --output HF_DIR [--dtype float32]

transformers.AutoModelForCausalLM.from_pretrained(HF_DIR) loads the result. One safetensors shard per
decoder layer (plus one for embeddings/head) keeps each write small; float32 output is bit-exact with
the MaxText parameters (and so HF -> MaxText -> HF is bit-exact for float32 checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

from MaxText import checkpointing, models
from MaxText import config as config_lib
from MaxText.config import Config, ConfigError
from MaxText.convert import hf_mapping
from MaxText.convert.hf_to_maxtext import get

DTYPES = ("float32", "bfloat16", "float16")


def to_hf(kernel: np.ndarray, rule: hf_mapping.Rule) -> np.ndarray:
  """Our parameter slice -> its HF tensor (or rule.cols of it): the inverse of hf_to_maxtext.to_maxtext."""
  kernel = np.asarray(kernel)
  if rule.perm is not None:
    kernel = kernel[..., np.argsort(rule.perm)]
  if rule.n_in is None:
    return kernel.reshape(hf_mapping.hf_shape(rule, kernel.shape))
  matrix = kernel.reshape(int(np.prod(kernel.shape[: rule.n_in])), -1)  # [in, out]
  return matrix.T if rule.transpose else matrix


def load(c: Config) -> dict:
  """The params of `c` (from load_parameters_path) as a pure dict of host arrays."""
  model = nnx.eval_shape(lambda: models.build(c, nnx.Rngs(params=0)))
  abstract = nnx.state(model, nnx.Param)
  params = checkpointing.load_params(c.load_parameters_path, abstract)
  return jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def _shard_of(name: str) -> str:
  parts = name.split(".")
  layer = parts[:2] in (["model", "layers"], ["transformer", "h"])
  return f"layer-{int(parts[2]):05d}" if layer else "other"


def convert(c: Config, output: str, dtype: str = "float32") -> None:
  import torch  # noqa: PLC0415 (optional dependency; safetensors' torch writer handles bfloat16)
  from safetensors.torch import save_file  # noqa: PLC0415

  if not c.load_parameters_path:
    raise ConfigError("Set load_parameters_path= to the MaxText params to export")
  params = load(c)
  os.makedirs(output, exist_ok=True)
  shards: dict[str, dict[str, torch.Tensor]] = {}
  pieces: dict[str, list] = {}  # fused HF tensors (GPT-2's c_attn) come in column ranges
  for rule in hf_mapping.rules(c, models.family(c).stacks(c), params):
    array = to_hf(get(params, rule.path)[rule.index], rule)
    pieces.setdefault(rule.hf_name, []).append(((rule.cols or (0, 0))[0], array))
  for name, parts in pieces.items():
    array = np.concatenate([a for _, a in sorted(parts, key=lambda p: p[0])], axis=-1)
    tensor = torch.from_numpy(np.ascontiguousarray(array, np.float32)).to(getattr(torch, dtype))
    shards.setdefault(_shard_of(name), {})[name] = tensor
  weight_map = {}
  for i, tensors in enumerate(shards[name] for name in sorted(shards)):
    filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(tensors, os.path.join(output, filename), metadata={"format": "pt"})
    weight_map |= {name: filename for name in tensors}
  with open(os.path.join(output, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(output, "config.json"), "w") as f:
    json.dump(hf_mapping.hf_config(c, dtype), f, indent=1)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("config", nargs="+", help="CONFIG.yml load_parameters_path=... [key=value ...]")
  parser.add_argument("--output", required=True, help="Hugging Face directory to write")
  parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the written tensors")
  args = parser.parse_args(argv)
  jax.config.update("jax_platforms", "cpu")
  try:
    c = config_lib.load([*args.config, "dtype=float32"])
    convert(c, args.output, args.dtype)
  except ConfigError as e:
    sys.exit(f"Conversion error: {e}")
  print(f"Wrote {args.output}")


if __name__ == "__main__":
  main(sys.argv[1:])
