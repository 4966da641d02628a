"""Say before it hurts: before a run allocates its state, what it needs per device against what is free.

The state (params + optimizer state) and its gradients are exact, from the state's shardings (nothing
allocated); the activations are auto-fit's estimate (autofit_estimate.py: what remat_policy keeps, a layer's
backward workspace, the logits). Free memory: on CPU the host's MemAvailable, shared by the process's CPU
devices; on an accelerator each device's memory_stats(). Where the exact part alone exceeds what is free, the
run cannot fit: a ConfigError says how much is missing and what to try. Where the estimate comes within
WARN_FROM of it, a warning says it will likely be killed for lack of memory. On CPU a step expected to take
long says so, with the time. XLA's exact figure for a real target: train_compile.py (docs/aot.md).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax

from MaxText import autofit_estimate, flops, sharding
from MaxText.config import Config
from MaxText.errors import ConfigError

GiB = 2**30
SLOW_STEP_S = 30.0  # on CPU, say how long a step should take when it is longer than this
# The activation estimate is calibrated on TPU compiles; XLA on CPU keeps more (float32 copies of bfloat16 work,
# whole logits): warn from this share of the free memory up. The seed's 1B model on one CPU device: 19.1 GiB
# estimated, 20.2 GiB free, killed for lack of memory at about 24 GiB.
WARN_FROM = 0.85
CPU_EFFICIENCY = 0.5  # the share of the measured matmul peak a CPU train step reaches (the quick start: ~0.5)


class Need(NamedTuple):
  """Bytes per device of one train step."""

  exact: int  # state + gradients (+ the accumulator): from the shardings
  activations: float  # estimated
  devices: int  # the devices that share `free` (the CPU devices of this process; 1 on an accelerator)

  @property
  def total(self) -> float:
    return self.exact + self.activations


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of `tree`'s arrays (abstract ones too: shard shapes from their shardings)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


def need(config: Config, mesh: Any, abstract_state: Any) -> Need:
  state, params = per_device_bytes(abstract_state), per_device_bytes(abstract_state.params)
  split = autofit_estimate.Split(mesh.shape.get("fsdp", 1), mesh.shape.get("tensor", 1), mesh.shape.get("expert", 1))
  batch_shards = math.prod(mesh.shape[a] for a in sharding.data_axes(config) if a in mesh.shape)
  facts = autofit_estimate.Facts(split, mesh.size, state, params, 0.0, batch_shards, 0.0, {})
  d = autofit_estimate.dims(config)
  try:
    e = autofit_estimate.estimate(
      d, facts, config.remat_policy, config.per_device_batch_size, max(1, config.gradient_accumulation_steps)
    )
    exact, activations = int(e.fixed), e.activations
  except (KeyError, ZeroDivisionError):  # a policy or layout the estimate does not model: the exact part only
    exact, activations = state + params, 0.0
  cpu = mesh.devices.flat[0].platform == "cpu"
  return Need(
    exact, activations, sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index()) if cpu else 1
  )


def free_bytes(device: Any) -> int | None:
  """Bytes free for `device`: the host's MemAvailable for a CPU device, else its allocator's limit less its use;
  None where neither can be read."""
  if device.platform == "cpu":
    try:
      with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
      return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
      return None
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def announce(config: Config, mesh: Any, spec: Any, global_batch: int, peak_flops: float) -> None:
  """check() for a run about to build its state (`spec`: state.StateSpec); process 0 prints the lines."""
  if not config.check_memory_fit:
    return
  per_token = flops.training_flops_per_token(config, flops.abstract_model(config, spec)).total
  lines = check(config, mesh, spec.abstract, per_token * global_batch * config.max_target_length, peak_flops)
  if lines and jax.process_index() == 0:
    print("\n".join(lines), flush=True)


def check(config: Config, mesh: Any, abstract_state: Any, flops_per_step: float, peak_flops: float) -> list[str]:
  """Raise ConfigError where the run cannot fit (one process); otherwise the warning lines to print."""
  if not config.check_memory_fit:
    return []
  n = need(config, mesh, abstract_state)
  device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  free = free_bytes(device)
  where = "the host" if device.platform == "cpu" else f"each {device.device_kind}"
  lines = []
  if free is not None:
    exact, total = n.exact * n.devices, n.total * n.devices
    what = (
      f"this run needs {total / GiB:.1f} GiB ({exact / GiB:.1f} GiB of parameters, optimizer state and gradients"
      f"{', for ' + str(n.devices) + ' CPU devices' if n.devices > 1 else ''}; {(total - exact) / GiB:.1f} GiB of "
      f"activations, estimated) but {where} has {free / GiB:.1f} GiB free"
    )
    hint = (
      "use a smaller recipe (e.g. quickstart) or model (model_name, base_num_decoder_layers, base_emb_dim), "
      "a smaller per_device_batch_size, "
      "remat_policy=full, weight_dtype=bfloat16; train_compile.py gives XLA's exact figure for a real target "
      "(docs/aot.md); check_memory_fit=false skips this check"
    )
    if exact > free and jax.process_count() == 1:
      raise ConfigError(f"{what}: {(exact - free) / GiB:.1f} GiB is missing before any activation; {hint}")
    if total > WARN_FROM * free:
      lines.append(f"warning: {what}; it will likely be killed for lack of memory: {hint}")
  if device.platform == "cpu" and peak_flops > 0:
    seconds = flops_per_step / (peak_flops * n.devices * CPU_EFFICIENCY)
    if seconds > SLOW_STEP_S:
      lines.append(
        f"note: expect about {seconds:,.0f} s per step on this CPU ({flops_per_step / 1e12:,.1f} TFLOP per step); "
        f"{config.steps} steps would take about {seconds * config.steps / 3600:,.1f} h"
      )
  return lines
