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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from MaxText.config import Config

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")  # Qwix names a kernel's adapters <kernel name><suffix>


def enabled(config: Config) -> bool:
  return config.lora_rank > 0


def trainable_filter(config: Config) -> Any:
  """The nnx filter of the parameters that train: under LoRA the adapters (the base is frozen), else all.
  state.param_spec turns it into the model's state.Partition, the one owner of the trainable/frozen split."""
  return nnx.LoRAParam if enabled(config) else ...


def kernel_paths(unit: nnx.Module) -> list[str]:
  """'/'-joined paths of the modules of `unit` that own a `kernel` (the projections LoRA can target)."""
  return ["/".join(map(str, path)) for path, module in nnx.iter_modules(unit) if hasattr(module, "kernel")]


def add_adapters(unit: nnx.Module, config: Config, rngs: nnx.Rngs) -> nnx.Module:
  """`unit` (a decoder layer or LayerBlock, unstacked) with adapters on its matching projections.

  Qwix runs the unit once on a dummy batch [1, max_target_length] to find the projections and create
  their adapters; under jit or eval_shape that call is traced only (its result is unused, so XLA drops it).
  """
  provider = qwix.LoraProvider(module_path=config.lora_target_modules, rank=config.lora_rank, alpha=config.lora_alpha)
  length = config.max_target_length
  x = jnp.zeros((1, length, config.emb_dim), jnp.dtype(config.dtype))
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  segments = jnp.ones((1, length), jnp.int32)
  # One key for all of this unit's adapters, drawn after the base was built: base weights match lora_rank=0.
  adapted = qwix.apply_lora_to_model(unit, provider, x, positions, segments, None, None, rngs=nnx.Rngs(rngs.params()))
  nnx.pop(adapted, nnx.Intermediate)  # what the dummy call recorded (MoE load-balance losses) is not state
  if not jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam)):  # the run plan checked the targets against the layers
    raise ValueError(
      f"lora_target_modules={config.lora_target_modules!r} matches no projection of {kernel_paths(unit)}"
    )
  return adapted


def adapted_stacks(stacks: tuple[Any, ...], config: Config) -> tuple[Any, ...]:
  """The decoder's stacks (layers/decoder.Stack) with adapters added to each unit as it is made; unchanged
  when LoRA is off."""
  if not enabled(config):
    return stacks

  def with_adapters(make: Callable[..., nnx.Module]) -> Callable[..., nnx.Module]:
    def make_adapted(unit_config: Config, *, rngs: nnx.Rngs, plan: Any) -> nnx.Module:
      return add_adapters(make(unit_config, rngs=rngs, plan=plan), unit_config, rngs)

    return make_adapted

  return tuple(dataclasses.replace(s, make=with_adapters(s.make)) for s in stacks)


def adapted_tower(tower: nnx.Module, config: Config, rngs: nnx.Rngs) -> nnx.Module:
  """The vision tower (and projector) of a use_multimodal model, with adapters on the projections whose path
  inside the tower (e.g. `layers/0/query`, `mm_input_projection`) fully matches lora_vision_target_modules when
  LoRA is on and the tower trains (freeze_vision_encoder=false); else unchanged, so under LoRA a frozen tower
  has no adapters and nothing of it trains. Built last, so the base parameters stay those of lora_rank=0."""
  if not enabled(config) or config.freeze_vision_encoder:
    return tower
  provider = qwix.LoraProvider(
    module_path=config.lora_vision_target_modules, rank=config.lora_rank, alpha=config.lora_alpha
  )
  size = config.image_size_for_vit
  images = jnp.zeros((1, 1, size, size, config.num_channels_for_vit), jnp.dtype(config.dtype))  # one dummy image
  adapted = qwix.apply_lora_to_model(tower, provider, images, rngs=nnx.Rngs(rngs.params()))
  if not jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam)):  # the run plan checked the targets against the tower
    raise ValueError(
      f"lora_vision_target_modules={config.lora_vision_target_modules!r} matches no projection of {kernel_paths(tower)}"
    )
  return adapted


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
