"""Device mesh from the ici_*/dcn_* keys, and logical axis names -> mesh shardings.

Model code names logical axes (`embed`, `mlp`, `activation_batch`, ...); `logical_axis_rules` in
base.yml maps them to the mesh axes built here. Nothing in layers/ or models/ names a mesh axis.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import config_checks
from MaxText.config import Config
from MaxText.errors import ConfigError


def _fill(prefix: str, config: Config, total: int, what: str) -> list[int]:
  """Parallelism per mesh axis for `prefix` (ici|dcn), with one -1 filled so the product is total."""
  keys = [f"{prefix}_{config_checks.AXIS_KEY[a]}_parallelism" for a in config.mesh_axes]
  sizes = [config[k] for k in keys]
  unknown = [k for k, s in zip(keys, sizes) if s == -1]
  if len(unknown) > 1:
    raise ConfigError(f"At most one {prefix}_* parallelism may be -1; got {', '.join(unknown)}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(f"{prefix}_* parallelism values must be positive or -1: {dict(zip(keys, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  named = " * ".join(f"{k}({s})" for k, s in zip(keys, sizes) if s not in (1, -1)) or f"all {prefix}_* = 1"
  if unknown:
    if total % known:
      raise ConfigError(f"{named} = {known} does not divide the {total} {what}; {unknown[0]} cannot be filled")
    sizes[keys.index(unknown[0])] = total // known
  elif known != total:
    raise ConfigError(f"{named} = {known} != {total} {what}")
  return sizes


def num_slices(config: Config, devices: Sequence[Any]) -> int:
  """num_slices, or detected: TPU slices from slice_index; elsewhere each process (host) is a slice."""
  if config.num_slices > 0:
    return config.num_slices
  if all(getattr(d, "platform", "") == "tpu" for d in devices):
    # A single TPU slice (and libtpu's AOT description of one) has no slice_index: one slice, however
    # many hosts. Counting hosts here made v5e-256 a 64-slice data-parallel mesh with fsdp=4.
    return 1 + max(getattr(d, "slice_index", 0) or 0 for d in devices)
  return len({d.process_index for d in devices})


def _has_slices(devices: Sequence[Any]) -> bool:
  # CPU/GPU devices of a multi-process job report slice_index 0 everywhere: only TPU slices are real.
  return all(getattr(d, "platform", "") == "tpu" and hasattr(d, "slice_index") for d in devices)


def create_mesh(config: Config, devices: Sequence[Any] | None = None) -> Mesh:
  """The device mesh: ici_* within a slice, dcn_* across slices (hybrid mesh)."""
  devices = list(jax.devices() if devices is None else devices)
  slices = num_slices(config, devices)
  if len(devices) % slices:
    raise ConfigError(f"{len(devices)} devices do not split into num_slices={slices} equal slices")
  ici = _fill("ici", config, len(devices) // slices, "devices per slice")
  dcn = _fill("dcn", config, slices, "slices (num_slices)")
  if slices == 1:
    try:
      grid = mesh_utils.create_device_mesh(ici, devices)
    except (NotImplementedError, ValueError, AssertionError):
      # Devices without a physical topology (CPU, GPU across processes) take the plain order.
      grid = np.array(devices).reshape(ici)
  else:
    dcn_full = [d * i for d, i in zip(dcn, ici)]
    if _has_slices(devices):
      grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    else:  # processes stand in for slices: process-major order keeps each slice's devices together
      ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
      grid = np.array(ordered).reshape(dcn + ici).transpose(_interleave(len(ici))).reshape(dcn_full)
  return Mesh(grid, tuple(config.mesh_axes))


def _interleave(n: int) -> list[int]:
  """Axis order that turns a [dcn..., ici...] array into [dcn_0, ici_0, dcn_1, ici_1, ...]."""
  return [axis for pair in zip(range(n), range(n, 2 * n)) for axis in pair]


def axis_rules(config: Config) -> tuple[tuple[str, Any], ...]:
  """logical_axis_rules from the config as flax expects them: (name, mesh axes | axis | None)."""
  rules = []
  for name, target in config.logical_axis_rules:
    if isinstance(target, (list, tuple)):
      target = tuple(target) or None
    rules.append((name, target))
  return tuple(rules)


def logical_to_mesh(spec_tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
  """Map a tree of logical PartitionSpecs to NamedShardings on `mesh`."""
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(spec), rules)),
    spec_tree,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def fit(named: NamedSharding, shape: Sequence[int]) -> NamedSharding:
  """`named` with every dimension of `shape` that its mesh axes do not divide left unsharded: e.g. a stack
  of one layer under 2 pipeline stages (its `layers` dim cannot split; the other dims keep their axes)."""
  spec = list(named.spec) + [None] * (len(shape) - len(named.spec))
  for i, axes in enumerate(spec):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if shape[i] % math.prod(named.mesh.shape[a] for a in names):
      spec[i] = None
  return NamedSharding(named.mesh, PartitionSpec(*spec), memory_kind=named.memory_kind)


TPU_LANES = 128  # the minor dimension of a TPU array tile: a smaller minor dimension is padded up to it


def lane_layout(shape: Sequence[int], named: NamedSharding) -> Layout | None:
  """The TPU layout that keeps the larger of the last two dims of `shape`'s shard under `named` minor, or
  None where the default layout (last dim minor) already fills the 128 lanes or the other dim is no larger.

  FSDP can leave a weight's last dim small on each chip (mixtral's expert wo [E, F, D]: D = 4096 over fsdp
  64 is 64 per chip; deepseek3-671b's D = 7168 over fsdp 512 is 14). XLA:TPU gives the parameter itself a
  layout with F minor, but libtpu 0.0.52 kept D minor in the layer-stacked gradient of the scanned backward
  pass and in the bfloat16 copy of the stacked weight hoisted out of the layer loop, padded to 128 lanes:
  twice the bytes for mixtral, 9x for deepseek (benchmarks/README.md, "Like for like")."""
  if len(shape) < 2:
    return None
  *_, second, minor = named.shard_shape(tuple(shape))
  if minor >= TPU_LANES or second <= minor:
    return None
  return Layout(major_to_minor=(*range(len(shape) - 2), len(shape) - 1, len(shape) - 2))


def keep_lanes(x: jax.Array, named: NamedSharding) -> jax.Array:
  """x (sharded as `named`) with lane_layout's layout constraint where it has one; for TPU targets only
  (callers check: other backends have no lane padding, and XLA:CPU ignores or rejects the constraint)."""
  layout = lane_layout(x.shape, named)
  if layout is None:
    return x
  # Per shard (shard_map): jax 0.10.2's partitioner does not see through a layout constraint and made the
  # array whole on every chip (mixtral's wo gradient: 56 GiB buffers), even between sharding constraints.
  local = jax.shard_map(
    lambda shard: with_layout_constraint(shard, layout), mesh=named.mesh, in_specs=named.spec, out_specs=named.spec
  )
  return local(x)


def data_axes(config: Config) -> tuple[str, ...]:
  return tuple(a for group in config.data_sharding for a in group)


def input_sharding(config: Config, mesh: Mesh, rank: int = 2) -> NamedSharding:
  """Sharding of a [batch, ...] input array of `rank` axes ([batch, length] by default): the batch over
  the data_sharding mesh axes, the other axes replicated."""
  return NamedSharding(mesh, PartitionSpec(data_axes(config), *[None] * (rank - 1)))


def global_batch_size(config: Config, mesh: Mesh, per_device: float | None = None) -> int:
  """per_device_batch_size x devices, checked to be whole and to split over the batch axes."""
  per_device = config.per_device_batch_size if per_device is None else per_device
  exact = per_device * mesh.size
  if abs(exact - round(exact)) > 1e-6 or round(exact) == 0:
    raise ConfigError(
      f"per_device_batch_size({per_device}) * {mesh.size} devices = {exact:g} is not a positive whole "
      "global batch; choose a per_device_batch_size that gives one"
    )
  batch = round(exact)
  shards = math.prod(mesh.shape[a] for a in data_axes(config))
  if batch % shards:
    raise ConfigError(
      f"global batch {batch} does not split over the {shards} devices of the batch axes "
      f"{data_axes(config)}; raise per_device_batch_size or change the mesh"
    )
  micro = config.gradient_accumulation_steps
  if batch % micro or (batch // micro) % shards:
    raise ConfigError(
      f"global batch {batch} does not split into gradient_accumulation_steps={micro} micro-batches "
      f"that each split over {shards} batch shards"
    )
  stages = config_checks.pipeline_stages(config)
  pipe = stages if config.num_pipeline_microbatches == -1 else config.num_pipeline_microbatches
  # A pipeline microbatch is sharded over the batch axes other than `stage` (that one holds the stages).
  stage_free = math.prod(mesh.shape[a] for a in data_axes(config) if a != "stage")
  if stages > 1 and ((batch // micro) % pipe or (batch // micro // pipe) % stage_free):
    raise ConfigError(
      f"the {batch // micro} rows a forward pass takes (global batch {batch} / gradient_accumulation_steps={micro}) "
      f"do not split into {pipe} pipeline microbatches that each split over {stage_free} batch shards; "
      "change num_pipeline_microbatches or per_device_batch_size"
    )
  return batch


@contextlib.contextmanager
def activate(config: Config, mesh: Mesh):
  """Mesh + logical axis rules in scope, so logical activation constraints in the model resolve."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
    yield
