"""Peak dense bf16 FLOP/s and HBM bytes per device, keyed by `jax.Device.device_kind`.

MFU divides the model FLOP/s a device achieves by its peak from this table. Figures are the
vendors' published dense (not 2:4 sparse) bf16 numbers. A "device" is what JAX calls one: a whole
chip on TPU v4/v5p (megacore) and on v5e/v6e/GPUs, but one TensorCore of the two on a TPU v2/v3
chip, so those entries are half the per-chip figure.

Lookup rule: the lower-cased device_kind is tested against each entry's patterns in table order;
the first entry with a pattern that is a substring wins. More specific entries come first ("v5
lite" before "tpu v5", "gh200" before "h200", "l40s" before "l4").
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform as host_platform
import socket
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from MaxText import paths

GiB = 2**30


class DeviceSpec(NamedTuple):
  """Published figures for one device kind."""

  name: str
  patterns: tuple[str, ...]  # lower-case substrings of device_kind, any of which selects this entry
  peak_flops: float  # dense bf16 FLOP/s per JAX device
  hbm_bytes: int  # HBM per JAX device


# fmt: off
DEVICE_SPECS: tuple[DeviceSpec, ...] = (
  # TPUs (cloud.google.com/tpu/docs/system-architecture-tpu-vm and the per-version pages).
  DeviceSpec("TPU v2", ("tpu v2",), 22.5e12, 8 * GiB),  # 45 TFLOP/s, 16 GiB per chip; 2 cores per chip
  DeviceSpec("TPU v3", ("tpu v3",), 61.5e12, 16 * GiB),  # 123 TFLOP/s, 32 GiB per chip; 2 cores per chip
  DeviceSpec("TPU v4 lite", ("tpu v4 lite", "v4i"), 138e12, 8 * GiB),  # v4i inference chip: 138 TFLOP/s, 8 GiB
  DeviceSpec("TPU v4", ("tpu v4",), 275e12, 32 * GiB),  # 275 TFLOP/s bf16, 32 GiB HBM2 per chip
  DeviceSpec("TPU v5e", ("v5 lite", "v5e", "v5litepod"), 197e12, 16 * GiB),  # 197 TFLOP/s bf16, 16 GiB HBM2
  DeviceSpec("TPU v5p", ("v5p", "tpu v5"), 459e12, 95 * GiB),  # 459 TFLOP/s bf16, 95 GiB HBM2e
  DeviceSpec("TPU v6e", ("v6 lite", "v6e", "trillium"), 918e12, 32 * GiB),  # Trillium: 918 TFLOP/s, 32 GiB
  # NVIDIA (datasheets; "dense" is half the headline with-sparsity figure).
  DeviceSpec("B200", ("b200",), 2.25e15, 180 * GiB),  # HGX B200: 4.5 PFLOP/s sparse bf16, 180 GB HBM3e
  DeviceSpec("GH200 144GB", ("gh200 144g",), 989e12, 144 * GiB),  # GH200: H100-class 989 TFLOP/s, 144 GB HBM3e
  DeviceSpec("GH200", ("gh200",), 989e12, 96 * GiB),  # GH200 480GB: 989 TFLOP/s dense bf16, 96 GB HBM3
  DeviceSpec("H200", ("h200",), 989e12, 141 * GiB),  # H200 SXM: 1,979 TFLOP/s sparse bf16, 141 GB HBM3e
  DeviceSpec("H100 PCIe", ("h100 pcie",), 756e12, 80 * GiB),  # H100 PCIe: 1,513 TFLOP/s sparse, 80 GB HBM2e
  DeviceSpec("H100 NVL", ("h100 nvl",), 835e12, 94 * GiB),  # H100 NVL: 1,671 TFLOP/s sparse, 94 GB HBM3
  DeviceSpec("H100 SXM", ("h100",), 989e12, 80 * GiB),  # "NVIDIA H100 80GB HBM3": 1,979 sparse, 80 GB HBM3
  DeviceSpec("A100 80GB", ("a100-sxm4-80gb", "a100 80gb"), 312e12, 80 * GiB),  # A100: 312 TFLOP/s dense bf16
  DeviceSpec("A100 40GB", ("a100",), 312e12, 40 * GiB),  # A100 40GB (SXM4/PCIe): 312 TFLOP/s, 40 GB HBM2
  DeviceSpec("L40S", ("nvidia l40s",), 362e12, 48 * GiB),  # L40S: 733 TFLOP/s sparse bf16, 48 GB GDDR6
  DeviceSpec("L40", ("nvidia l40",), 181e12, 48 * GiB),  # L40: 362 TFLOP/s sparse bf16, 48 GB GDDR6
  DeviceSpec("L4", ("nvidia l4",), 121e12, 24 * GiB),  # L4: 242 TFLOP/s sparse bf16, 24 GB GDDR6
)
# fmt: on


def device_spec(device_kind: str) -> DeviceSpec | None:
  """The table entry for a device_kind string (see the module docstring for the rule), or None."""
  kind = device_kind.lower()
  for spec in DEVICE_SPECS:
    if any(p in kind for p in spec.patterns):
      return spec
  return None


def _default_device(device: Any | None) -> Any:
  return jax.devices()[0] if device is None else device


class Peak(NamedTuple):
  """The peak FLOP/s MFU is measured against, and where it comes from."""

  flops: float  # FLOP/s per JAX device
  source: str  # e.g. "TPU v5e table (bf16)" or "measured float32 matmul, cpu, 1/8 of the host"

  @property
  def measured(self) -> bool:
    """A measured matmul rather than a published figure: a lower bound on what the device can do."""
    return self.source.startswith("measured")

  def describe(self) -> str:
    """One line for a run's start-up header: `peak 0.0312 TFLOP/s/device (measured ...)`."""
    return f"peak {self.flops / 1e12:.3g} TFLOP/s/device ({self.source})"


def peak(device: Any | None = None, dtype: str | None = None) -> Peak:
  """Peak FLOP/s of `device` (default: the first JAX device) and its source.

  From DEVICE_SPECS when the device kind is listed (the table's bf16 figure whatever `dtype` is, as
  MaxText reports MFU). Otherwise (CPU, an unlisted kind) there is no published figure: the peak is a
  square matmul in `dtype` (the run's config.dtype; default float32 on CPU, bfloat16 elsewhere),
  measured once per host and kept a week in the user's cache (`cache_dir`; see `_host_peak_flops`), so MFU is
  relative to what this host achieves on that dtype.
  The CPU devices of one process (e.g. --xla_force_host_platform_device_count=8) share the host's
  cores, so each gets an equal share of the host's measured peak.
  """
  device = _default_device(device)
  spec = device_spec(device.device_kind)
  if spec is not None:
    return Peak(spec.peak_flops, f"{spec.name} table, bf16")
  platform = device.platform
  dtype = jnp.dtype(dtype or ("float32" if platform == "cpu" else "bfloat16")).name
  measured, when = _host_peak_flops(platform, dtype)
  source = f"measured {dtype} matmul, {platform}" + (f", on {when}" if when else "")
  if platform == "cpu":
    share = max(1, len(jax.local_devices(backend="cpu")))
    return Peak(measured / share, source + (f", 1/{share} of the host" if share > 1 else ""))
  return Peak(measured, source)


def peak_flops_per_device(device: Any | None = None, dtype: str | None = None) -> float:
  """Peak FLOP/s per device for MFU: `peak(device, dtype).flops` (see `peak`)."""
  return peak(device, dtype).flops


def hbm_bytes_per_device(device: Any | None = None) -> int | None:
  """HBM bytes of `device` from DEVICE_SPECS; None on CPU or for a kind not in the table."""
  spec = device_spec(_default_device(device).device_kind)
  return None if spec is None else spec.hbm_bytes


# Timing budget of the measured peak: at least MIN_RUNS runs, more until MIN_TIMED_S of timed work,
# never past MAX_TIMED_S (one slow run on a loaded host may exceed it alone). Best of several runs:
# other processes on a shared host only ever slow a run down, so the fastest is the least disturbed.
MIN_RUNS, MIN_TIMED_S, MAX_TIMED_S = 5, 0.5, 1.0


# A measured peak is kept per host in the user's cache (MAXTEXT_CACHE_DIR, else $XDG_CACHE_HOME/maxtext, else
# ~/.cache/maxtext) for PEAK_CACHE_DAYS, so each later run on this host starts without the ~1 s of matmuls. The key
# names the host, its processor and core count, the device kind and jax's version: another machine, or a host
# whose hardware or jax changed, measures again. MAXTEXT_CACHE_DIR=off measures in every process.
PEAK_CACHE_FILE, PEAK_CACHE_DAYS = "measured_peaks.json", 7


def cache_dir() -> str | None:
  """Where MaxText keeps small per-host facts (the measured peak); None when MAXTEXT_CACHE_DIR=off."""
  chosen = os.environ.get("MAXTEXT_CACHE_DIR", "")
  if chosen == "off":
    return None
  if chosen:
    return chosen
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "maxtext")


def _host_key(platform: str, dtype: str) -> str:
  kind = jax.local_devices(backend=platform)[0].device_kind
  host = f"{socket.gethostname()} | {_cpu_model()} x{os.cpu_count()}"
  return f"{host} | {platform}: {kind} | {dtype} | jax {jax.__version__}"


def _cpu_model() -> str:
  """The processor's name (Linux: /proc/cpuinfo's "model name"), else the machine type (x86_64, arm64)."""
  try:
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
  except OSError:
    names = []
  return names[0] if names else host_platform.machine()


@functools.cache
def _host_peak_flops(platform: str, dtype: str) -> tuple[float, str]:
  """(FLOP/s of the host's `platform` device in `dtype`, the date it was measured if read from the cache, else "").

  Read from the per-host cache when it holds a recent entry for this host; otherwise measured (about 1 s) and
  written there. A cache that cannot be read or written is ignored: the peak is then measured in each process.
  """
  directory, key = cache_dir(), _host_key(platform, dtype)
  path = os.path.join(directory, PEAK_CACHE_FILE) if directory else None
  entries = _read_cache(path)
  if _recent(entries.get(key)):
    return float(entries[key]["flops"]), entries[key]["date"]
  flops = _measured_peak_flops(platform, dtype)
  if path:
    _write_cache(path, {**entries, key: {"flops": flops, "date": datetime.date.today().isoformat()}})
  return flops, ""


def _recent(entry: Any) -> bool:
  try:
    age = datetime.date.today() - datetime.date.fromisoformat(entry["date"])
    return float(entry["flops"]) > 0 and 0 <= age.days < PEAK_CACHE_DAYS
  except (KeyError, TypeError, ValueError):
    return False  # none, or malformed: measured again and replaced


def _read_cache(path: str | None) -> dict[str, Any]:
  if not path:
    return {}
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    return {}
  return entries if isinstance(entries, dict) else {}


def _write_cache(path: str, entries: dict[str, Any]) -> None:
  """Write the whole cache atomically (paths.write_atomic). A cache that cannot be written (a read-only home, a full
  disk) is left as it was: the next process measures again."""
  try:
    paths.makedirs(os.path.dirname(path))
    paths.write_atomic(path, json.dumps(entries, indent=1, sort_keys=True))
  except OSError:
    pass


@functools.cache
def _measured_peak_flops(platform: str, dtype: str) -> float:
  """Best FLOP/s of a square `dtype` matmul on the first device of `platform`, after a warm-up.

  2048 on CPU (smaller matmuls underrate the host: training matmuls beat them), 8192 elsewhere.
  About 0.5-1 s of timed runs plus one warm-up run and the compilation.
  """
  n = 2048 if platform == "cpu" else 8192
  device = jax.local_devices(backend=platform)[0]
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  matmul = jax.jit(jnp.matmul)
  matmul(a, a).block_until_ready()  # compile and warm up outside the timing
  best, spent, runs = float("inf"), 0.0, 0
  while spent < MAX_TIMED_S and (runs < MIN_RUNS or spent < MIN_TIMED_S):
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    elapsed = time.perf_counter() - start
    best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
  return 2.0 * n**3 / best


# ------------------------------------------------------------------ AOT compile topologies


class Topology(NamedTuple):
  """A target for train_compile: what `jax.experimental.topologies.get_topology_desc` needs."""

  platform: str  # "tpu" | "cuda"
  topology_name: str  # e.g. "v5e:16x16" (TPU chips grid) or "8" (GPUs per host)
  chip_config_name: str  # "megacore" (v4/v5p: one device per chip) | "default"
  chips_per_host_bounds: tuple[int, int, int]  # the chips one host (process) drives
  devices_per_host: int
  gpu_target: str = ""  # GPU targets: the GPU_TARGETS_DIR file naming the GPU XLA compiles for


def _cube_shape(chips: int) -> tuple[int, int, int]:
  """3D torus shape of a v4/v5p slice: 4x4x4 cubes, as cubic as possible (v5p-640 -> 4x4x20)."""
  small = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
  if chips in small:
    return small[chips]
  if chips % 64:
    raise ValueError(f"{chips} chips is not a whole number of 4x4x4 cubes")
  cubes = chips // 64
  best = min(
    ((a, b, cubes // (a * b)) for a in range(1, cubes + 1) for b in range(a, cubes + 1) if cubes % (a * b) == 0),
    key=lambda s: (max(s), s),
  )
  a, b, c = sorted(best)
  if c < b:
    raise ValueError(f"no shape for {chips} chips")
  return (4 * a, 4 * b, 4 * c)


def _grid_2d(chips: int) -> tuple[int, int]:
  """2D shape of a v5e/v6e slice: 1x1, 2x2, 2x4, 4x4, 4x8, ..., 16x16."""
  side = 1
  while side * side * 4 <= chips:
    side *= 2
  return (side, chips // side)


def tpu_topology(name: str) -> Topology:
  """MaxText's accelerator names: v4-8..v4-4096 and v5p-8..v5p-12288 (cores = 2 x chips);
  v5e-1..v5e-256 and v6e-1..v6e-256 (chips)."""
  family, _, size = name.lower().partition("-")
  if not size.isdigit():
    raise ValueError(f"{name!r} is not a TPU name like v5e-256")
  size = int(size)
  if family in ("v4", "v5p"):
    limit = {"v4": 4096, "v5p": 12288}[family]
    if size < 8 or size > limit or size % 8 or (size > 64 and size % 128):
      raise ValueError(f"{name!r}: {family} sizes are 8, 16, 32, 64, then multiples of 128 up to {limit}")
    shape = _cube_shape(size // 2)
    grid = "x".join(map(str, shape))
    prefix = "v4" if family == "v4" else "v5"
    return Topology("tpu", f"{prefix}:{grid}", "megacore", (2, 2, 1), 4)
  if family in ("v5e", "v6e"):
    if size not in (1, 4, 8, 16, 32, 64, 128, 256):
      raise ValueError(f"{name!r}: {family} sizes are 1, 4, 8, 16, 32, 64, 128, 256")
    rows, cols = _grid_2d(size)
    bounds = (1, 1, 1) if size == 1 else (2, 2, 1)
    return Topology("tpu", f"{family}:{rows}x{cols}", "default", bounds, math.prod(bounds))
  raise ValueError(f"unknown TPU family in {name!r}; use v4-N, v5e-N, v5p-N or v6e-N")


# GPU machine types: GPUs per host and the GPU, whose description XLA compiles for (a GpuTargetConfigProto
# text file in GPU_TARGETS_DIR); compile_topology_num_slices counts hosts.
GPU_TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "gpu_targets")


class GpuMachine(NamedTuple):
  gpus_per_host: int
  target: str  # GPU_TARGETS_DIR/<target>.txtpb


GPU_MACHINES = {
  "a3": GpuMachine(8, "h100_sxm"),  # A3 High: 8 x H100 SXM 80GB
  "a3mega": GpuMachine(8, "h100_sxm"),  # A3 Mega: 8 x H100 SXM 80GB (more network than a3)
  "a3ultra": GpuMachine(8, "h200_sxm"),  # A3 Ultra: 8 x H200 141GB
  "a4": GpuMachine(8, "b200"),  # A4: 8 x B200 180GB
}


def gpu_target_config(name: str) -> str:
  """The text of GPU_TARGETS_DIR/<name>.txtpb: the GPU described as XLA's GpuTargetConfigProto."""
  with open(os.path.join(GPU_TARGETS_DIR, f"{name}.txtpb")) as f:
    return f.read()


def compile_topology(name: str) -> Topology:
  """The Topology for a compile_topology name (TPU names as above; GPU machine types a3, a3mega, ...)."""
  if name.lower() in GPU_MACHINES:
    machine = GPU_MACHINES[name.lower()]
    gpus = machine.gpus_per_host
    return Topology("cuda", str(gpus), "default", (gpus, 1, 1), gpus, machine.target)
  return tpu_topology(name)
