"""LoRA through Qwix: low-rank adapters on chosen projections of every decoder layer, the base frozen.

With lora_rank = r > 0, each projection whose module path (inside a decoder layer, e.g.
`self_attention/query`, `mlp/wi/0`) fully matches lora_target_modules computes

    y = x @ W + (lora_alpha / r) * (x @ A) @ B        A [in, r] (He-uniform), B [r, out] (zeros)

so a fresh adapter leaves the model unchanged. Qwix (qwix.LoraProvider) intercepts the layer's
jax.lax.dot_general, creates A and B as nnx.LoRAParam next to the kernel (`kernel_lora_a`,
`kernel_lora_b`, logical axes derived from the kernel's) and adds the low-rank term; we only choose
where and how large. Qwix creates adapters on a module's first call, so they are added to each layer
as it is built (`adapted_stacks`), before the decoder stacks and scans its layers: the scanned body
works on temporary copies of a layer, where a parameter created on first use would be lost.
A use_multimodal model whose tower trains (freeze_vision_encoder=false) gets adapters on the tower's and
projector's projections too (`adapted_tower`, lora_vision_target_modules); a frozen tower gets none.

Training splits the parameters into the adapters (the only thing differentiated and optimised) and
the frozen base; checkpoints keep the adapters. That split is the state spec's (state.Partition, built
from `trainable_filter`). Export and decode fold the adapters into the base kernels (`merged`). docs/lora.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from MaxText.config import Config
from MaxText.layers.model_config import ModelConfig

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")  # Qwix names a kernel's adapters <kernel name><suffix>


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """The adapters the model is built with (models.build gives it to the Decoder): the LoRA keys of the run."""

  rank: int  # lora_rank
  alpha: float  # lora_alpha
  target_modules: str  # lora_target_modules
  vision_target_modules: str | None  # lora_vision_target_modules when the tower trains; None: a frozen tower
  trace_length: int  # max_target_length: the length a layer is traced at to find its projections

  @classmethod
  def from_config(cls, config: Config) -> LoraConfig | None:
    """The run's LoRA settings; None when lora_rank is 0 (no adapters)."""
    if not enabled(config):
      return None
    tower = None if config.freeze_vision_encoder else config.lora_vision_target_modules
    return cls(config.lora_rank, config.lora_alpha, config.lora_target_modules, tower, config.max_target_length)


def enabled(config: Config) -> bool:
  return config.lora_rank > 0


def trainable_filter(config: Config) -> Any:
  """The nnx filter of the parameters that train: under LoRA the adapters (the base is frozen), else all.
  state.param_spec turns it into the model's state.Partition, the one owner of the trainable/frozen split."""
  return nnx.LoRAParam if enabled(config) else ...


def kernel_paths(unit: nnx.Module) -> list[str]:
  """'/'-joined paths of the modules of `unit` that own a `kernel` (the projections LoRA can target)."""
  return ["/".join(map(str, path)) for path, module in nnx.iter_modules(unit) if hasattr(module, "kernel")]


def add_adapters(unit: nnx.Module, config: ModelConfig, lora: LoraConfig, rngs: nnx.Rngs) -> nnx.Module:
  """`unit` (a decoder layer or LayerBlock of the model `config`, unstacked) with adapters on its matching
  projections.

  Qwix runs the unit once on a dummy batch [1, trace_length] to find the projections and create
  their adapters; under jit or eval_shape that call is traced only (its result is unused, so XLA drops it).
  """
  provider = qwix.LoraProvider(module_path=lora.target_modules, rank=lora.rank, alpha=lora.alpha)
  length = lora.trace_length
  x = jnp.zeros((1, length, config.emb_dim), jnp.dtype(config.dtype))
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  segments = jnp.ones((1, length), jnp.int32)
  # One key for all of this unit's adapters, drawn after the base was built: base weights match lora_rank=0.
  adapted = qwix.apply_lora_to_model(unit, provider, x, positions, segments, None, None, rngs=nnx.Rngs(rngs.params()))
  nnx.pop(adapted, nnx.Intermediate)  # what the dummy call recorded (MoE load-balance losses) is not state
  if not jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam)):  # the run plan checked the targets against the layers
    raise ValueError(f"lora_target_modules={lora.target_modules!r} matches no projection of {kernel_paths(unit)}")
  return adapted


def adapted_stacks(stacks: tuple[Any, ...], lora: LoraConfig | None) -> tuple[Any, ...]:
  """The decoder's stacks (layers/decoder.Stack) with adapters added to each unit as it is made; unchanged
  when LoRA is off (None)."""
  if lora is None:
    return stacks

  def with_adapters(make: Callable[..., nnx.Module]) -> Callable[..., nnx.Module]:
    def make_adapted(unit_config: ModelConfig, *, rngs: nnx.Rngs, plan: Any) -> nnx.Module:
      return add_adapters(make(unit_config, rngs=rngs, plan=plan), unit_config, lora, rngs)

    return make_adapted

  return tuple(dataclasses.replace(s, make=with_adapters(s.make)) for s in stacks)


def tower_projections(tower: nnx.Module) -> list[tuple[str, tuple[Any, ...], bool]]:
  """(name, module path, stacked) of each projection of a vision tower. The name is the path inside the tower
  with the layer index, `layers/<i>/query`, whatever the layout: a stacked (scanned) encoder gives its one
  module under every index, with stacked=True; the projector's names have no index (`mm_input_projection`)."""
  stacked_layers = not isinstance(getattr(tower, "layers", None), nnx.List)
  out = []
  for path, module in nnx.iter_modules(tower):
    if not hasattr(module, "kernel"):
      continue
    if path[:1] == ("layers",) and stacked_layers:
      rest = "/".join(map(str, path[1:]))
      out += [(f"layers/{i}/{rest}", tuple(path), True) for i in range(tower.num_layers)]
    else:
      out.append(("/".join(map(str, path)), tuple(path), False))
  return out


def tower_paths_shown(tower: nnx.Module) -> str:
  """The tower's projection names for an error message: the first layer's and the projector's."""
  names = [n for n, _, _ in tower_projections(tower)]
  return ", ".join(n for n in names if not n.startswith("layers/") or n.startswith("layers/0/"))


def tower_targets(tower: nnx.Module, pattern: str) -> list[tuple[tuple[Any, ...], int]]:
  """(module path, layers) of the tower's projections whose name fully matches `pattern`; layers > 0: a stacked
  module of that many layers (adapted in every layer: a scanned encoder's layers cannot differ). ValueError
  when nothing matches, or when a pattern picks some of a stacked projection's layers."""
  chosen: dict[tuple[Any, ...], list[str]] = {}
  stacked: dict[tuple[Any, ...], bool] = {}
  for name, path, is_stacked in tower_projections(tower):
    if re.fullmatch(pattern, name):
      chosen.setdefault(path, []).append(name)
      stacked[path] = is_stacked
  if not chosen:
    raise ValueError(
      f"lora_vision_target_modules={pattern!r} matches no projection of the vision tower; their paths are: "
      f"{tower_paths_shown(tower)} (every layer has the projections of layers/0)"
    )
  out = []
  for path, names in chosen.items():
    layers = tower.num_layers if stacked[path] else 0
    if layers and len(names) != layers:
      raise ValueError(
        f"lora_vision_target_modules={pattern!r} matches {names[0]} in {len(names)} of {layers} vision layers; "
        "scanned layers are adapted alike: match every layer, or set scan_layers=false"
      )
    out.append((path, layers))
  return out


def _adapt_projection(module: nnx.Module, lora: LoraConfig, key: jax.Array, layers: int) -> nnx.Module:
  """One DenseGeneral with Qwix adapters, created by one call on a dummy input; `layers` > 0: a stacked module,
  adapted layer by layer (its adapters get the leading `layers` axis, as the scanned text layers' do)."""
  provider = qwix.LoraProvider(module_path=".*", rank=lora.rank, alpha=lora.alpha)

  def adapt(m: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
    return qwix.apply_lora_to_model(m, provider, jnp.zeros((1, *m.in_features), m.dtype), rngs=rngs)

  if not layers:
    return adapt(module, nnx.Rngs(key))

  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0, 0), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def each(m: nnx.Module, rngs: nnx.Rngs) -> nnx.Module:
    return adapt(m, rngs)

  return each(module, nnx.Rngs(key))


def adapted_tower(tower: nnx.Module, lora: LoraConfig | None, rngs: nnx.Rngs) -> nnx.Module:
  """The vision tower (and projector) of a use_multimodal model, with adapters on the projections whose name
  (tower_projections: `layers/0/query`, `mm_input_projection`, ...) fully matches lora_vision_target_modules when
  LoRA is on and the tower trains (freeze_vision_encoder=false); else unchanged, so under LoRA a frozen tower
  has no adapters and nothing of it trains. Built last, so the base parameters stay those of lora_rank=0.
  Each projection is adapted on its own (a scanned encoder cannot be run by Qwix's tracing call); in a stacked
  encoder a projection gets adapters in every layer or in none."""
  if lora is None or lora.vision_target_modules is None:
    return tower
  key = rngs.params()  # one key for the tower's adapters, drawn after the base was built
  for i, (path, layers) in enumerate(tower_targets(tower, lora.vision_target_modules)):
    parent = tower
    for part in path[:-1]:
      parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    module = parent[path[-1]] if isinstance(path[-1], int) else getattr(parent, path[-1])
    adapted = _adapt_projection(module, lora, jax.random.fold_in(key, i), layers)
    if isinstance(path[-1], int):
      parent[path[-1]] = adapted
    else:
      setattr(parent, path[-1], adapted)
  return tower


def merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """kernel + scale * A @ B, in float32, cast back to the kernel's dtype.

  Qwix's adapters of a dense kernel [*in, *out] (contracted dims first, as DenseGeneral stores them)
  are A [..., prod(in), r] and B [..., r, prod(out)], `...` being the stacked-layers axis under
  scan_layers: A @ B reshaped is the kernel's update.
  """
  delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
  if delta.size != kernel.size or delta.shape[:-2] != kernel.shape[: delta.ndim - 2]:
    raise ValueError(f"adapters {a.shape} @ {b.shape} do not fold into a kernel of shape {kernel.shape}")
  return (kernel.astype(jnp.float32) + scale * delta.reshape(kernel.shape)).astype(kernel.dtype)


def _merge_tree(tree: Any, scale: float) -> Any:
  if not isinstance(tree, dict):
    return tree
  out = {}
  for key, value in tree.items():
    if isinstance(key, str) and key.endswith(ADAPTER_SUFFIXES):
      continue
    a, b = (tree.get(f"{key}{s}") for s in ADAPTER_SUFFIXES)
    out[key] = _merge_tree(value, scale) if a is None else merged_kernel(value, a, b, scale)
  return out


def merged(config: Config, params: nnx.State) -> nnx.State:
  """The base parameters with every adapter folded into its kernel: the parameters of the same model
  with lora_rank=0, whose outputs equal the adapted model's (up to float rounding)."""
  if not enabled(config):
    return params
  _, frozen = nnx.split_state(params, nnx.LoRAParam, ...)
  base = jax.tree.map(lambda x: x, frozen)  # a copy: replace_by_pure_dict is in place
  nnx.replace_by_pure_dict(base, _merge_tree(nnx.to_pure_dict(params), config.lora_alpha / config.lora_rank))
  return base


def target_problem(config: Config, model_config: Any, stacks: Any, tower: Callable[..., nnx.Module], plan: Any):
  """Why lora_target_modules or lora_vision_target_modules cannot run, or None. lora_target_modules must match
  a projection of every layer kind (Qwix matches module paths with re.fullmatch), lora_vision_target_modules
  one of a trained vision tower (built by `tower`); checked on abstract layers, so nothing is allocated. The
  run plan's builder raises the answer as a ConfigError (planner.build)."""
  if not enabled(config):
    return None
  for stack in stacks:
    with nnx.use_eager_sharding(False):  # as models.build: shapes only, no placement
      unit = nnx.eval_shape(lambda s=stack: s.make(model_config, rngs=nnx.Rngs(0), plan=plan))
    paths = kernel_paths(unit)
    if not any(re.fullmatch(config.lora_target_modules, p) for p in paths):
      return (
        f"lora_target_modules={config.lora_target_modules!r} matches no projection of a decoder layer; "
        f"their paths are: {', '.join(paths)}"
      )
  if model_config.vision is not None and not config.freeze_vision_encoder:  # the tower gets adapters too
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: tower(model_config, rngs=nnx.Rngs(0)))
    try:
      tower_targets(abstract, config.lora_vision_target_modules)
    except ValueError as e:
      return f"{e} (or set freeze_vision_encoder=true)"
  return None
