"""Serving with int8 weights (quantization=int8w) and an int8 KV cache (quantize_kvcache): checks, the
post-training quantization of a float checkpoint, and quantized params checkpoints.

int8w replaces the kernel of every matmul the rules select (attention and MLP projections, MoE experts,
the output head) by a qwix QArray: int8 values and one float32 scale per output channel (absmax over
the contracted dims). Layers dequantize at use (layers/linears.py `weight`), so HBM holds int8 and the
matmul runs in `dtype`. Embedding tables (gathers) and MoE routers stay in float: routing decisions are
sensitive to small errors and the router is tiny.

qwix's PtqProvider swaps weights while it intercepts a model call, but the decoder applies its layers as
pure functions inside jax.lax.scan (nnx.merge per layer), so the swapped weights would not persist into
the params tree; the weights are therefore quantized here, on the tree, with qwix's own QArray and rule
matching (QuantizationRule.module_path), which needs no model call.

A saved quantized checkpoint stores each QArray as {"qvalue": int8, "scale": float32} under the
kernel's path; load_parameters_path recognises it and decode serves it without quantizing again.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import checkpointing
from MaxText import state as state_lib
from MaxText.config import Config
from MaxText.errors import ConfigError
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.moe import MoeBlock

SERVING_MODES = ("", "int8w")  # the quantization values decode serves (int8/fp8 are training modes)
MLA_BLOCKS = ("deepseek",)  # decoder_blocks whose attention caches a latent (no quantized cache)
MOE_WEIGHTS = ("wi_0", "wi_1", "wo")  # [E, D, F], [E, D, F], [E, F, D]: the contracted dim is axis 1
QUANTIZED_KEYS = ("qvalue", "scale")

Path = tuple[str, ...]


def check(config: Config) -> None:
  """ConfigError for serving settings that cannot work together, before any device work."""
  if config.quantization not in SERVING_MODES:
    raise ConfigError(
      f"quantization={config.quantization!r} is a training mode; decode serves quantization=int8w "
      '(int8 weights) or "" (off)'
    )
  if config.quantize_kvcache and config.decoder_block in MLA_BLOCKS:
    raise ConfigError(
      f"quantize_kvcache=true is not supported with MLA (decoder_block={config.decoder_block}: the latent "
      "cache stays in dtype); set quantize_kvcache=false"
    )
  if config.save_quantized_params_path and config.quantization != "int8w":
    raise ConfigError("save_quantized_params_path saves int8 weights: add quantization=int8w")


def _weight_only_rules(config: Config) -> list[qwix.QuantizationRule]:
  """int8 weights of every dense and expert matmul, per output channel; activations unquantized. The
  MoE router (module path ending in `gate`) is left out."""
  del config  # one recipe today; the config picks it (quantization=int8w)
  return [qwix.QuantizationRule(module_path=r"^(?!(?:.*/)?gate$).*$", weight_qtype=jnp.int8)]


def _rule_for(rules: list[qwix.QuantizationRule], module_path: str) -> qwix.QuantizationRule | None:
  return next((r for r in rules if re.fullmatch(r.module_path, module_path)), None)


def matmul_weights(graphdef: nnx.GraphDef, abstract: nnx.State, rules: list[qwix.QuantizationRule]) -> dict:
  """{param path: contracted axes} for the matmul weights the rules quantize; a leading layers axis
  (scan_layers) shifts the axes. Reads the module structure only (abstract params suffice)."""
  model = nnx.merge(graphdef, abstract)
  found = {}
  for path, module in nnx.iter_modules(model):
    names = tuple(path)
    rule = _rule_for(rules, "/".join(map(str, names)))
    if rule is None or rule.weight_qtype is None:
      continue
    if isinstance(module, DenseGeneral):
      n_in = len(module.in_features)
      lead = module.kernel.ndim - n_in - len(module.out_features)
      found[(*names, "kernel")] = tuple(range(lead, lead + n_in))
    elif isinstance(module, MoeBlock):
      for name in MOE_WEIGHTS:
        found[(*names, name)] = (getattr(module, name).ndim - 2,)
  return found


def _channelwise(ndim: int, contracted: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(a for a in range(ndim) if a not in contracted)


def _map_targets(params: nnx.State, targets: dict, fn: Callable[[Any, tuple[int, ...]], Any]) -> nnx.State:
  """A copy of params where each target Param's value is fn(value, contracted axes)."""
  flat = dict(nnx.to_flat_state(params))
  for path, contracted in targets.items():
    key = tuple(path)
    flat[key] = flat[key].replace(fn(flat[key].get_value(), contracted))
  return nnx.from_flat_state(flat)


def quantize(params: nnx.State, targets: dict) -> nnx.State:
  """Float params -> the same tree with int8 QArrays (float32 per-channel scales) at `targets`."""

  def one(x, contracted):
    return qwix.quantize(x, jnp.int8, channelwise_axes=_channelwise(x.ndim, contracted), scale_dtype=jnp.float32)

  return _map_targets(params, targets, one)


def _scale_sharding(sharding: NamedSharding, contracted: tuple[int, ...], ndim: int) -> NamedSharding:
  """The kernel's sharding with its contracted (size-1 in the scale) dims unsharded."""
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return NamedSharding(sharding.mesh, PartitionSpec(*(None if i in contracted else s for i, s in enumerate(spec))))


def abstract_quantized(abstract: nnx.State, targets: dict) -> nnx.State:
  """The abstract params of quantize(params): QArray leaves of ShapeDtypeStructs, sharded like the kernel
  (the scale's contracted dims replicated) when `abstract` carries shardings."""

  def one(x, contracted):
    scale_shape = tuple(1 if i in contracted else n for i, n in enumerate(x.shape))
    sharding = getattr(x, "sharding", None)
    scale_sharding = None if sharding is None else _scale_sharding(sharding, contracted, x.ndim)
    return qwix.QArray(
      qvalue=jax.ShapeDtypeStruct(x.shape, jnp.int8, sharding=sharding),
      scale=jax.ShapeDtypeStruct(scale_shape, jnp.float32, sharding=scale_sharding),
      qtype=jnp.int8,
    )

  return _map_targets(abstract, targets, one)


def is_qarray(x: Any) -> bool:
  return isinstance(x, qwix.QArray)


def to_storable(params: nnx.State) -> dict:
  """A pure dict for orbax: each QArray becomes {"qvalue", "scale"}."""
  pure = nnx.to_pure_dict(params)
  return jax.tree.map(lambda x: {"qvalue": x.qvalue, "scale": x.scale} if is_qarray(x) else x, pure, is_leaf=is_qarray)


def from_storable(pure: dict, template: nnx.State) -> nnx.State:
  """Inverse of to_storable, into the structure (and Param metadata) of `template`."""

  def rebuild(tree):
    if isinstance(tree, dict) and set(tree) == set(QUANTIZED_KEYS):
      return qwix.QArray(qvalue=tree["qvalue"], scale=tree["scale"], qtype=jnp.int8)
    return {k: rebuild(v) for k, v in tree.items()} if isinstance(tree, dict) else tree

  flat = dict(nnx.to_flat_state(template))
  values = _flatten(rebuild(pure))
  return nnx.from_flat_state({k: v.replace(values[k]) for k, v in flat.items()})


def _flatten(tree: Any, prefix: Path = ()) -> dict:
  """Nested dicts -> {path: leaf}, a QArray counting as one leaf; integer-like keys as in nnx paths."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flatten(v, (*prefix, k)))
  return out


def is_quantized_checkpoint(path: str) -> bool:
  """Whether the params checkpoint at `path` holds quantized weights (a "qvalue" key somewhere)."""
  try:
    tree = checkpointing.saved_tree(path)
  except Exception:  # not readable as an orbax checkpoint: the restore names the problem
    return False
  found = []
  jax.tree_util.tree_map_with_path(lambda p, _: found.append(any(getattr(k, "key", None) == "qvalue" for k in p)), tree)
  return any(found)


def for_serving(config: Config, spec: state_lib.ParamSpec, params: nnx.State) -> nnx.State:
  """Float params (sharded as spec.shardings) -> int8 matmul weights (quantization=int8w), in one jitted
  program whose outputs land where abstract_quantized places them."""
  targets = matmul_weights(spec.graphdef, spec.abstract, _weight_only_rules(config))
  shardings = jax.tree.map(lambda a: a.sharding, abstract_quantized(spec.abstract, targets))
  return jax.jit(lambda p: quantize(p, targets), out_shardings=shardings)(params)


def load_saved(config: Config, spec: state_lib.ParamSpec) -> nnx.State:
  """The int8 params of a checkpoint that `save` wrote, into spec's shardings; no quantizing again."""
  path = config.load_parameters_path
  if config.quantization != "int8w":
    raise ConfigError(
      f"load_parameters_path={path!r} holds int8 weights (a quantized checkpoint): add quantization=int8w"
    )
  targets = matmul_weights(spec.graphdef, spec.abstract, _weight_only_rules(config))
  return load(path, abstract_quantized(spec.abstract, targets))


def save(path: str, params: nnx.State) -> None:
  """A params-only checkpoint of quantized params, usable as load_parameters_path with quantization=int8w."""
  checkpointing.save_params(path, to_storable(params))


def load(path: str, abstract_q: nnx.State) -> nnx.State:
  """Quantized params saved by `save`, restored into abstract_q's shapes and shardings."""
  # As an nnx.State, so that load_params can also re-layout a checkpoint saved with the other scan_layers.
  restored = checkpointing.load_params(path, nnx.State(to_storable(abstract_q)))
  return from_storable(nnx.to_pure_dict(restored) if isinstance(restored, nnx.State) else restored, abstract_q)


def weight_bytes(params: Any) -> int:
  """Bytes of every array in the params (int8 values and their scales counted as stored)."""
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
