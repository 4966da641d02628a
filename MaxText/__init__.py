"""MaxText-style LLM training in pure Python/JAX."""

import sys
import time

# The goodput clock's origin (goodput.program_start): the first import of MaxText, which every entry point makes
# before jax. Not the process's start: a shell that runs `bash setup.sh && exec python3 ...` in one process would
# charge the setup to the run.
IMPORTED_AT = time.perf_counter()

if sys.version_info < (3, 12):  # noqa: UP036 (jax >= 0.11, which requirements.txt pins, needs 3.12)
  sys.exit(
    f"MaxText needs Python >= 3.12 (this is {sys.version.split()[0]}): run `bash setup.sh`, "
    "then `source .venv/bin/activate`, and run the command again"
  )


def _requirements_present() -> None:
  """A bare `No module named 'jax'` deep in an import says nothing of the fix: name the missing requirements."""
  import importlib.util  # noqa: PLC0415

  missing = [m for m in ("numpy", "yaml", "jax", "flax", "optax", "orbax") if importlib.util.find_spec(m) is None]
  if missing:
    sys.exit(
      f"MaxText's requirements are not installed (no module {', '.join(map(repr, missing))} in {sys.executable}): "
      "run `bash setup.sh` and `source .venv/bin/activate`, or `pip install -r requirements.txt && pip install -e .`"
    )


_requirements_present()


def require_torch(what: str, modules: tuple[str, ...] = ("torch", "transformers")) -> None:
  """torch and transformers are not MaxText's requirements: only the live Hugging Face comparisons and the script
  that regenerates their reference files need them. Where `what` does, a missing one is a line naming the setup."""
  import importlib.util  # noqa: PLC0415

  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  if missing:
    sys.exit(
      f"{what} needs {' and '.join(missing)}, which `TORCH=1 bash setup.sh` installs (requirements-torch.txt); "
      f"{sys.executable} has none"
    )


def _accelerator_present() -> bool:
  """A TPU (Google's PCI vendor id, /dev/accel*, /dev/vfio), an NVIDIA GPU, or AMD's ROCm driver (/dev/kfd)."""
  import glob  # noqa: PLC0415

  vendors = set()
  for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(path) as f:
        vendors.add(f.read().strip())
    except OSError:
      continue
  devices = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*") + glob.glob("/dev/kfd")
  return bool(vendors & {"0x1ae0", "0x10de"} or devices)


def _cpu_only_when_no_accelerator() -> None:
  """With libtpu installed (setup.sh installs it for AOT compiles) but no TPU, GPU or ROCm device on the machine,
  JAX would still start libtpu, which prints a screen of TPU_WORKER_HOSTNAMES / accelerator-type errors before
  falling back to the CPU. Name the CPU ourselves then: the same devices, no noise. An explicit JAX_PLATFORMS
  (even empty) is left alone, and TPU topologies for train_compile.py come from libtpu either way."""
  import importlib.util  # noqa: PLC0415
  import os  # noqa: PLC0415

  if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None or _accelerator_present():
    return  # JAX decides, as it always does
  os.environ["JAX_PLATFORMS"] = "cpu"
  # train_compile.py still loads libtpu for a TPU topology: without these it prints the same screen (it would ask
  # the cloud metadata server for the local chips). Neither changes the topology compiled for, which is named.
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
  if "jax" in sys.modules:  # imported before us: its config already read the environment
    sys.modules["jax"].config.update("jax_platforms", "cpu")


_cpu_only_when_no_accelerator()


def _signals_from_the_start() -> None:
  """Run as one of MaxText's programs (train.py, decode.py, ...), a SIGINT/SIGTERM/SIGHUP exits in one line from
  here on, also during the imports before its start-up (preemption.install_for_entry_point)."""
  from MaxText import preemption  # noqa: PLC0415 (light: it imports jax only where it uses it)

  preemption.install_for_entry_point()


_signals_from_the_start()
