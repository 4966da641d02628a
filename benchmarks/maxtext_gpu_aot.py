"""Upstream MaxText's train_compile for an NVIDIA GPU target, on a machine without a GPU.

    PYTHONPATH=.venv/gpu-aot JAX_PLATFORMS=cpu /path/to/maxtext-venv/bin/python benchmarks/maxtext_gpu_aot.py \
      a3mega HOSTS CONFIG.yml [key=value ...]

MaxText (0.2.5) compiles for GPUs only on a GPU machine: its train_compile takes `jax.devices()`, the local
GPUs, and mocks the number of processes. Here its `main` runs unchanged but for that one function, whose
devices come instead from JAX's CUDA plugin given our description of the machine's GPU
(MaxText/configs/gpu_targets/): the devices our train_compile compiles for, so that the two steps' memory
compares on the same compiler and target. Prints MaxText's own report (`Memory analysis: ...`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _accelerators():
  """Our MaxText/accelerators.py by path (the maxtext venv has its own `MaxText` package)."""
  path = os.path.join(HERE, "..", "MaxText", "accelerators.py")
  spec = importlib.util.spec_from_file_location("our_accelerators", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def gpu_devices(machine: str, hosts: int) -> list:
  accelerators = _accelerators()
  target = accelerators.compile_topology(machine)
  from jax.experimental import topologies

  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  desc = topologies.get_topology_desc(
    platform="cuda",
    topology_name=machine,
    topology=f"1x{hosts}x{target.devices_per_host}",
    target_config=accelerators.gpu_target_config(target.gpu_target),
  )
  return list(desc.devices)


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first): MACHINE HOSTS CONFIG [key=value ...] as MaxText takes them."""
  if len(argv) < 4 or argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
  machine, hosts, rest = argv[1], int(argv[2]), argv[3:]
  devices = gpu_devices(machine, hosts)
  from jax.experimental import mesh_utils
  from jax.sharding import AxisType, Mesh
  from maxtext.trainers.pre_train import train_compile as mt
  from maxtext.utils import maxtext_utils

  def topology_mesh(config):  # MaxText's get_topology_mesh, with the plugin's devices for jax.devices()
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    # Its dcn axes span slices by slice_index, which GPU devices do not set: hosts (processes) are the
    # granules of a GPU job, as jax's mesh_utils has them with process_is_granule.
    hybrid = mesh_utils.create_hybrid_device_mesh
    maxtext_utils.mesh_utils.create_hybrid_device_mesh = functools.partial(hybrid, process_is_granule=True)
    grid = maxtext_utils.create_device_mesh(config, devices)
    explicit = str(config.shard_mode).lower().endswith("explicit")
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(config.mesh_axes)
    return Mesh(np.asarray(grid), config.mesh_axes, axis_types=types)

  mt.get_topology_mesh = topology_mesh
  # MaxText knows one GPU name, a3 (8 GPUs per host); the GPU itself is MACHINE's, through `devices`.
  mt.main(["train_compile", *rest, "compile_topology=a3", f"compile_topology_num_slices={hosts}"])


if __name__ == "__main__":
  main(sys.argv)
