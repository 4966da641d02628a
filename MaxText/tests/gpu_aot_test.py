"""GPU targets compiled on this CPU machine: the target descriptions shipped for each GPU machine type, the
one-line error without JAX's CUDA plugin, and a real compile for two A3 Mega hosts through the plugin that
`GPU_AOT=1 bash setup.sh` installs in <venv>/gpu-aot (TEST=1 does not: no nvidia package by default)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from MaxText import accelerators, gpu_aot, train_compile
from MaxText.errors import ConfigError
from MaxText.tests.conftest import ROOT, SIZES, cfg

PLUGIN_HERE = importlib.util.find_spec("jax_plugins") is not None and any(
  importlib.util.find_spec(f"jax_plugins.{name}") for name in ("xla_cuda12", "xla_cuda13")
)
PLUGIN_APART = os.path.isdir(os.path.join(gpu_aot.GPU_AOT_DIR, "jax_plugins", "xla_cuda13"))
NO_PLUGIN = f"JAX's CUDA plugin is not in {gpu_aot.GPU_AOT_DIR}: GPU_AOT=1 bash setup.sh installs it"


def target_field(text: str, name: str) -> str:
  match = re.search(rf"^\s*{name}: \"?([^\"\n]+?)\"?\s*(#.*)?$", text, re.M)
  assert match, f"{name} missing"
  return match.group(1)


@pytest.mark.parametrize("machine", sorted(accelerators.GPU_MACHINES))
def test_each_gpu_machine_names_a_target_whose_gpu_the_memory_table_knows(machine):
  topology = accelerators.compile_topology(machine)
  assert topology.platform == "cuda" and topology.devices_per_host == 8
  text = accelerators.gpu_target_config(topology.gpu_target)
  kind = target_field(text, "device_description_str")
  spec = accelerators.device_spec(kind)  # the report's HBM line comes from this entry
  assert spec is not None, kind
  memory = int(target_field(text, "device_memory_size"))
  assert 0.95 * spec.hbm_bytes < memory <= spec.hbm_bytes, (kind, memory, spec.hbm_bytes)
  assert re.search(r"cuda_compute_capability \{ major: (9|10) ", text)  # Hopper 9.0, Blackwell 10.0


@pytest.mark.skipif(PLUGIN_HERE, reason="JAX's CUDA plugin is installed in this environment")
def test_without_the_plugin_the_error_says_how_to_install_it(tmp_path):
  with pytest.raises(ConfigError, match=r"CUDA plugin.*requirements-gpu-aot\.txt.*PYTHONPATH=") as e:
    train_compile.topology_devices(cfg(tmp_path, "t", "compile_topology=a3", "compile_topology_num_slices=2"))
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "attention, saveable", [("autoselected", False), ("cudnn_flash_te", False), ("dot_product", True)]
)
def test_a_gpu_step_with_cudnn_attention_is_refused_a_file_before_compiling(tmp_path, attention, saveable):
  path = os.path.join(tmp_path, "step.pkl")
  config = cfg(tmp_path, "t", "compile_topology=a3mega", f"attention={attention}", f"compiled_trainstep_file={path}")
  if saveable:
    gpu_aot.check_saveable(config)
  else:
    with pytest.raises(ConfigError, match="compiled_trainstep_file .* needs attention=dot_product"):
      gpu_aot.check_saveable(config)


def gpu_compile(*overrides):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([gpu_aot.GPU_AOT_DIR, ROOT]))
  command = [sys.executable, "MaxText/train_compile.py", "MaxText/configs/base.yml", "log_config=false", *SIZES]
  return subprocess.run([*command, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not PLUGIN_APART, reason=NO_PLUGIN)
def test_tiny_model_compiles_for_two_a3mega_hosts_without_a_gpu():
  result = gpu_compile("compile_topology=a3mega", "compile_topology_num_slices=2", "per_device_batch_size=2")
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  out = result.stdout
  assert "compiled for 16 x NVIDIA H100 80GB HBM3" in out
  assert "'data': 2" in out and "'fsdp': 8" in out  # one host per data shard, fsdp over a host's GPUs
  assert "attention: cudnn_flash_te" in out  # the GPU default, built by cuDNN for a GPU that is not here
  assert "per device: arguments" in out and "HBM per device 80.00 GiB" in out
