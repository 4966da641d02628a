"""Serving memory with quantization: the bytes decode holds for the weights, and the KV-cache bytes per
token, for bf16 vs quantization=int8w vs quantize_kvcache (and both): a table, not a timed test.

  python3 benchmarks/quantized_memory.py [model_name=llama2-7b ...] [key=value ...]

Without a model_name: the ~110M-parameter benchmark model (train_benchmark.BENCHMARK), llama2-7b,
llama3.1-8b (grouped-query attention) and mixtral-8x7b (experts). Computed from shapes (nnx.eval_shape;
nothing is allocated), exactly as MaxText/inference/engine.load_params serves them: float parameters in
`dtype` (bfloat16), int8 matmul weights with a float32 scale per output channel, embeddings, norms and MoE
routers in `dtype`. KV bytes per token: the whole decode cache of all layers over its slots, batch 1.
MaxText/tests/quantized_decode_test.py checks on a real model that the served arrays have these dtypes.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from train_benchmark import BENCHMARK  # beside this file: a script imports from its own directory

from MaxText import config, launch
from MaxText import state as state_lib
from MaxText.inference import quantize

MODELS = {
  "benchmark ~110M": BENCHMARK,
  "llama2-7b": ["model_name=llama2-7b"],
  "llama3.1-8b": ["model_name=llama3.1-8b"],
  "mixtral-8x7b": ["model_name=mixtral-8x7b"],
}
SETTINGS = {
  "bf16": [],
  "int8w": ["quantization=int8w"],
  "kv int8": ["quantize_kvcache=true"],
  "int8w + kv int8": ["quantization=int8w", "quantize_kvcache=true"],
}
CACHE_SLOTS = 256  # any length: bytes per token do not depend on it


def _nbytes(x) -> int:
  return x.size * jnp.dtype(x.dtype).itemsize


def weight_bytes(c: config.Config, spec: state_lib.ParamSpec) -> int:
  """Bytes of the parameters as decode serves them (floats cast to dtype; QArrays as stored)."""
  abstract = spec.abstract
  if c.quantization == "int8w":
    targets = quantize.matmul_weights(spec.graphdef, abstract, quantize._weight_only_rules(c))
    abstract = quantize.abstract_quantized(abstract, targets)
  total = 0
  for leaf in jax.tree.leaves(abstract, is_leaf=quantize.is_qarray):
    if quantize.is_qarray(leaf):
      total += _nbytes(leaf.qvalue) + _nbytes(leaf.scale)
    else:
      total += leaf.size * jnp.dtype(c.dtype).itemsize
  return total


def kv_bytes_per_token(spec: state_lib.ParamSpec) -> float:
  model = nnx.merge(spec.graphdef, spec.abstract)
  cache = jax.eval_shape(lambda: model.init_cache(1, CACHE_SLOTS))
  return sum(_nbytes(x) for x in jax.tree.leaves(cache)) / CACHE_SLOTS


def row(name: str, setting: str, overrides: list[str]) -> tuple[int, float, str]:
  c = config.load(
    [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=quantized_memory", *overrides, "dtype=bfloat16"]
  )
  quantize.check(c)
  spec = state_lib.param_spec(c)
  return weight_bytes(c, spec), kv_bytes_per_token(spec), f"| {name} | {setting} |"


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  launch.doc_help(argv[1:], __doc__)
  overrides = argv[1:]
  models = {" ".join(overrides): overrides} if any(a.startswith("model_name=") for a in overrides) else MODELS
  print(f"jax {jax.__version__}; weights as served (dtype bfloat16), KV cache of batch 1")
  print("| model | setting | weights (GiB) | vs bf16 | KV cache per token (KiB) | vs bf16 |")
  print("|---|---|---|---|---|---|")
  for name, base in models.items():
    rows = [row(name, s, [*base, *extra, *(overrides if models is MODELS else [])]) for s, extra in SETTINGS.items()]
    w0, kv0 = rows[0][0], rows[0][1]
    for w, kv, prefix in rows:
      print(f"{prefix} {w / 2**30:.3f} | {w / w0:.2f}x | {kv / 2**10:.2f} | {kv / kv0:.2f}x |", flush=True)


if __name__ == "__main__":
  main(sys.argv)
