"""Devices of an NVIDIA GPU target for train_compile, on a machine without a GPU.

JAX's CUDA plugin describes a GPU topology (partitions x hosts x GPUs per host) without touching a GPU
when it is given the GPU's description, XLA's GpuTargetConfigProto (accelerators.GPU_TARGETS_DIR); XLA then
compiles for that GPU as if it were there, running NVIDIA's ptxas for the kernels' machine code. What that
takes is requirements-gpu-aot.txt. It is best installed apart from the environment's own packages, because
the plugin, once on the path, loads in every jax program and, on a machine with no GPU, prints a CUDA
error at start unless JAX_PLATFORMS=cpu: `GPU_AOT=1 bash setup.sh` puts it in <venv>/gpu-aot, and
train_compile runs with `PYTHONPATH=<venv>/gpu-aot`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp

from MaxText import accelerators
from MaxText.config import Config
from MaxText.errors import ConfigError

GPU_AOT_DIR = os.path.join(sys.prefix, "gpu-aot")  # where setup.sh GPU_AOT=1 installs requirements-gpu-aot.txt


def install_hint() -> str:
  """How to get the plugin onto the path: PYTHONPATH when setup.sh installed it, else how to install it."""
  run = f"PYTHONPATH={GPU_AOT_DIR} python3 MaxText/train_compile.py ..."
  if os.path.isdir(os.path.join(GPU_AOT_DIR, "jax_plugins")):
    return f"it is installed in {GPU_AOT_DIR}: run {run}"
  return (
    f"install it with GPU_AOT=1 bash setup.sh (pip install --no-deps --target {GPU_AOT_DIR} -r "
    f"requirements-gpu-aot.txt), then run {run}"
  )


def devices(config: Config, target: accelerators.Topology, topologies: Any) -> list[Any]:
  """compile_topology_num_slices hosts of target.devices_per_host GPUs, each the GPU of target.gpu_target."""
  # The plugin checks the CUDA runtime libraries (a GPU machine's) when it loads, and fails without them;
  # a compile runs nothing on a GPU, so it loads unchecked. Set before JAX looks for plugins: nothing in
  # train_compile touches a backend before this.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  check_saveable(config)
  hosts, gpus = config.compile_topology_num_slices, target.devices_per_host
  try:
    desc = topologies.get_topology_desc(
      platform="cuda",
      topology_name=config.compile_topology,
      topology=f"1x{hosts}x{gpus}",  # partitions x hosts per partition x GPUs per host
      target_config=accelerators.gpu_target_config(target.gpu_target),
    )
  except Exception as e:  # NotImplementedError without the plugin; the plugin's own errors otherwise
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(
      f"compile_topology={config.compile_topology!r} needs JAX's CUDA plugin (requirements-gpu-aot.txt; no "
      f"GPU needed): {install_hint()} (JAX said: {said})"
    ) from None
  found = list(desc.devices)
  _check_compiler(config, found[0])
  return found


def _check_compiler(config: Config, device: Any) -> None:
  """Compile a one-op program first: without ptxas or libdevice this fails in one line, not after minutes."""
  shape = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
  try:
    jax.jit(jnp.exp).lower(shape).compile()
  except Exception as e:
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(
      f"compile_topology={config.compile_topology!r}: XLA cannot compile for {device.device_kind} here; it "
      f"needs NVIDIA's ptxas and libdevice (requirements-gpu-aot.txt): {install_hint()} (XLA said: {said[:300]})"
    ) from None


def check_saveable(config: Config) -> None:
  """Before compiling: jax (0.12) cannot save a step with cuDNN attention, the GPU default, because its
  custom partitioning rule does not pickle; with dot_product attention the GPU step saves."""
  cudnn = config.attention == "cudnn_flash_te" or (
    config.attention == "autoselected" and not config.attn_logits_soft_cap
  )
  if config.compiled_trainstep_file and cudnn:
    raise ConfigError(
      f"compiled_trainstep_file with compile_topology={config.compile_topology!r} needs attention=dot_product: "
      f"jax cannot save a GPU step with cuDNN attention (attention={config.attention}; its custom partitioning "
      "does not pickle). Compile without compiled_trainstep_file to size the run"
    )
