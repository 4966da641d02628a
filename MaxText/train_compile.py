"""Compile the real train step ahead of time for a topology you may not have, and report its memory.

python3 MaxText/train_compile.py MaxText/configs/base.yml compile_topology=v5e-256 \
  compile_topology_num_slices=2 per_device_batch_size=4 [compiled_trainstep_file=step.pickle]

The chain is train.py's (config -> mesh -> state spec -> jit_train_step) on the devices of a topology
description instead of real devices: TPU topologies come from libtpu (`DEVICE=tpu bash setup.sh`),
which compiles on a CPU-only machine, GPU machines (a3, a3mega, a3ultra, a4) from JAX's CUDA plugin given
the GPU's description (gpu_aot.py; no GPU needed); `compile_topology=cpu` (or empty) uses the local devices. The
result says per device how much memory the step needs against the device's HBM, its FLOPs and the
compile time; a step that does not fit exits non-zero with what to change. With
`compiled_trainstep_file`, the executable is saved and `train.py ... compiled_trainstep_file=FILE`
runs it instead of compiling.
"""

from __future__ import annotations

try:  # first: a signal during the imports below exits in one line (preemption.py)
  import MaxText  # noqa: F401
except ModuleNotFoundError as e:  # run as a file with the requirements alone: say what installs the package
  raise SystemExit(f"{e}: run `bash setup.sh` (or `pip install -e .` in this environment) first") from None

# isort: split
import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import (
  accelerators,
  autofit,
  checksums,
  compiled_step,
  console,
  gpu_aot,
  hlo_dump,
  launch,
  objectives,
  optimizers,
  planner,
  sharding,
)
from MaxText import flops as flops_lib
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.config import Config
from MaxText.errors import ConfigError

GiB = 2**30


class OutOfMemoryError(RuntimeError):
  """The compiled step does not fit in the target device's memory; the message says what to change."""


class CompileReport(NamedTuple):
  device_kind: str
  num_devices: int
  mesh_shape: dict[str, int]
  argument_bytes: int  # per device: state + batch (donated state included)
  output_bytes: int  # per device: new state + metrics
  alias_bytes: int  # per device: outputs written in place of donated arguments
  temp_bytes: int  # per device: activations and other scratch
  total_bytes: int  # arguments + outputs - aliased + temporaries: the peak the step needs
  hbm_bytes: int | None  # per device, from accelerators.DEVICE_SPECS (None on CPU)
  flops: float | None  # per device, from XLA's cost analysis of the compiled program (each loop body once)
  compile_seconds: float
  plan: tuple[str, ...] = ()  # the run plan's lines (planner.describe)
  model_flops: float | None = None  # per device per step, flops.py's count (6·N·T + attention): what MFU counts
  loops: int | None = None  # while loops in the compiled program (scanned layers, pipeline, ...); None: unknown
  reference_bytes: int = 0  # per device, of argument_bytes: TrainState.reference (DPO's copy, distill's teacher)


def topology_devices(config: Config) -> list[Any]:
  """The devices to compile for: a TPU/GPU topology description's, or the local devices."""
  name = config.compile_topology
  if name in ("", "cpu"):
    return list(jax.devices())
  try:
    target = accelerators.compile_topology(name)
  except ValueError as e:
    raise ConfigError(f"compile_topology={name!r}: {e}") from None
  from jax.experimental import topologies  # lazy: only AOT compilation needs it

  # libtpu lets one process at a time hold the chips; compiling for a topology uses none, so several
  # compiles (or a compile next to a training run) may share the machine.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

  if target.platform == "cuda":  # JAX's CUDA plugin, given the GPU's description: no GPU needed
    return gpu_aot.devices(config, target, topologies)
  try:
    desc = topologies.get_topology_desc(
      topology_name=target.topology_name,
      platform="tpu",
      chip_config_name=target.chip_config_name,
      chips_per_host_bounds=target.chips_per_host_bounds,
      num_slices=config.compile_topology_num_slices,
    )
  except Exception as e:  # jax raises RuntimeError/ValueError subclasses depending on the plugin
    raise ConfigError(  # the advice first: launch.one_line keeps only the first line of libtpu's message
      f"cannot describe TPU topology {name!r} ({target.topology_name}); compiling for TPUs needs libtpu: "
      f"DEVICE=tpu bash setup.sh (or pip install -r requirements-tpu.txt). libtpu said: {e}"
    ) from None
  return list(desc.devices)


def shaped_inputs(config: Config, mesh: Mesh) -> tuple[dict[str, jax.ShapeDtypeStruct], jax.ShapeDtypeStruct]:
  """The batch (the objective's fields) and the dropout key as train.py passes them, as shapes with shardings."""
  shape = (sharding.global_batch_size(config, mesh), config.max_target_length)
  shardings = steps.batch_shardings(config, mesh)
  fields = objectives.get(config).fields(config)
  batch = {
    k: jax.ShapeDtypeStruct((*shape[: f.rank - len(f.tail)], *f.tail), f.dtype, sharding=shardings[k])
    for k, f in fields.items()
    if k != "images"
  }
  if "images" in shardings:  # use_multimodal: tile slots per row (data/images.slots_per_row)
    size = (config.image_size_for_vit, config.image_size_for_vit, config.num_channels_for_vit)
    image_shape = (shape[0], config.image_tiles_per_row or config.images_per_row, *size)
    batch["images"] = jax.ShapeDtypeStruct(image_shape, jnp.float32, sharding=shardings["images"])
  key = jax.eval_shape(lambda: jax.random.fold_in(jax.random.key(0), 0))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  return batch, rng


def compile_train_step(config: Config, devices: Sequence[Any]) -> tuple[Any, CompileReport, Mesh]:
  """Lower and compile steps.jit_train_step (train.py's step, shardings and donation) for `devices`."""
  mesh = sharding.create_mesh(config, devices)
  objectives.get(config).check(config, sharding.global_batch_size(config, mesh))
  plan = planner.build(config, mesh)  # the layout, checked before compiling
  tx, schedule = optimizers.build(config)
  with sharding.activate(config, mesh):
    spec = state_lib.state_spec(config, tx, mesh, plan)
    batch, rng = shaped_inputs(config, mesh)
    start = time.perf_counter()
    try:
      with console.Heartbeat("compiling the train step"), _fresh_if_saved(config):
        compiled = steps.jit_train_step(config, mesh, tx, spec, schedule).lower(spec.abstract, batch, rng).compile()
    except Exception as e:  # XLA reports an HBM overflow as a compile error (RESOURCE_EXHAUSTED)
      _raise_if_out_of_memory(config, devices[0].device_kind, str(e))
      raise
    seconds = time.perf_counter() - start
  report = compile_report(compiled, devices, mesh, seconds, tuple(planner.describe(plan, config)))
  tokens = sharding.global_batch_size(config, mesh) * config.max_target_length
  per_token = flops_lib.training_flops_per_token(config, flops_lib.abstract_model(config, spec)).total
  report = report._replace(reference_bytes=per_device_bytes(spec.abstract.reference))
  return compiled, report._replace(model_flops=per_token * tokens / mesh.size, loops=_while_loops(compiled)), mesh


def per_device_bytes(tree: Any) -> int:
  """The bytes one device holds of `tree`'s jax.ShapeDtypeStruct leaves (each sharded by its .sharding)."""
  shards = [(x.sharding.shard_shape(x.shape), x.dtype.itemsize) for x in jax.tree.leaves(tree)]
  return sum(int(np.prod(shape)) * size for shape, size in shards)


@contextlib.contextmanager
def _fresh_if_saved(config: Config) -> Iterator[None]:
  """With compiled_trainstep_file, compile without jax's persistent compilation cache (JAX_COMPILATION_CACHE_DIR):
  an executable that cache hands back, serialized again, loads on CPU without its functions ("NOT_FOUND:
  Function ... not found" at the first step). jax decides once per process whether it uses the cache, so the
  switch is followed by reset_cache() both ways (the flag alone is ignored after the first compile)."""
  if not config.compiled_trainstep_file or not jax.config.jax_enable_compilation_cache:
    yield
    return
  from jax.experimental.compilation_cache import compilation_cache  # lazy: only this path needs it

  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def _while_loops(compiled: Any) -> int | None:
  """The while loops of the compiled program, whose bodies XLA's cost analysis counts once each."""
  try:
    return len(re.findall(r"\bwhile\(", compiled.as_text()))
  except Exception:  # a backend that cannot print its executable: say less, not fail the compile
    return None


def compile_report(
  compiled: Any, devices: Sequence[Any], mesh: Mesh, seconds: float, plan: tuple[str, ...] = ()
) -> CompileReport:
  """The memory per device, FLOPs and compile time of a compiled program (`seconds` to compile it)."""
  memory = compiled.memory_analysis()
  args, out = memory.argument_size_in_bytes, memory.output_size_in_bytes
  alias, temp = memory.alias_size_in_bytes, memory.temp_size_in_bytes
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  flops = float(cost["flops"]) if cost and "flops" in cost else None
  kind = devices[0].device_kind
  return CompileReport(
    kind, len(devices), dict(mesh.shape), args, out, alias, temp, args + out - alias + temp,
    accelerators.hbm_bytes_per_device(devices[0]), flops, seconds, plan,
  )  # fmt: skip


def format_report(report: CompileReport) -> str:
  gib = lambda b: f"{b / GiB:.2f} GiB"
  lines = [
    f"compiled for {report.num_devices} x {report.device_kind}, mesh {report.mesh_shape}, "
    f"in {report.compile_seconds:.1f} s",
    f"  per device: arguments {gib(report.argument_bytes)}, outputs {gib(report.output_bytes)} "
    f"(aliased {gib(report.alias_bytes)}), temporaries {gib(report.temp_bytes)}, total {gib(report.total_bytes)}",
  ]
  if report.reference_bytes:
    frozen = gib(report.reference_bytes)
    lines.append(f"  of the arguments: frozen reference/teacher params {frozen} (no optimizer state)")
  if report.hbm_bytes:
    lines.append(f"  HBM per device {gib(report.hbm_bytes)}: {100 * report.total_bytes / report.hbm_bytes:.0f}% used")
  lines += _flops_lines(report)
  lines += [f"  {line}" for line in report.plan]
  return "\n".join(lines)


def _flops_lines(report: CompileReport) -> list[str]:
  """The model's FLOPs (MFU's numerator) beside XLA's count, labelled for what it is: XLA's cost analysis
  counts a while loop's body once, not once per trip, so with scanned layers it falls far below the step."""
  lines = []
  if report.model_flops is not None:
    lines.append(f"  model FLOPs per device per step: {report.model_flops:.3e} (6·N·T + attention; what MFU counts)")
  if report.flops is None:
    return lines
  if report.loops == 0:
    what = "(remat recomputation and non-matmul ops included)"
  else:
    loops = "its loops" if report.loops is None else f"its {report.loops} loops"
    what = f"- a lower bound: the bodies of {loops} (e.g. scanned layers) are counted once, not per trip"
  return [*lines, f"  XLA cost analysis FLOPs per device per step: {report.flops:.3e} {what}"]


def _advice(config: Config) -> str:
  """Only the changes that would lower this config's memory."""
  steps = []
  if config.per_device_batch_size > 1 or config.gradient_accumulation_steps == 1:
    steps.append(
      f"lower per_device_batch_size (now {config.per_device_batch_size:g}) or raise gradient_accumulation_steps"
    )
  if config.remat_policy != "full":
    steps.append(f"rematerialise more with remat_policy=full (now {config.remat_policy})")
  if config.attention == "dot_product":
    steps.append(
      "use attention=autoselected (fused kernels) or a smaller attention_query_chunk "
      f"(now {config.attention_query_chunk})"
    )
  steps.append(
    "shard the state over more devices with ici_fsdp_parallelism / dcn_fsdp_parallelism (or a bigger compile_topology)"
  )
  return "; ".join(steps)


_SIZE = r"([0-9.]+\s*[KMGT]i?B?)"


def _raise_if_out_of_memory(config: Config, device_kind: str, error: str) -> None:
  """Turn XLA's RESOURCE_EXHAUSTED compile error into one that says by how much and what to change."""
  if "RESOURCE_EXHAUSTED" not in error and "Ran out of memory" not in error:
    return
  detail = ""
  # XLA:TPU: "the total memory required for HLO temporaries (141.39G) exceeds available HBM (15.75G)"
  need = re.search(rf"required for ([\w ]+?) \({_SIZE}\) exceeds available (\w+) \({_SIZE}\)", error)
  # older form: "Used 20.5G of 15.75G hbm. Exceeded hbm capacity by 4.75G."
  used = re.search(rf"Used {_SIZE} of {_SIZE} hbm.*?capacity by {_SIZE}", error, re.S)
  if need:
    over = _gib(need.group(2)) - _gib(need.group(4))
    detail = f" {need.group(1)} need {need.group(2)} of the {need.group(4)} available: {over:.2f} GiB over"
  elif used:
    detail = f" needs {used.group(1)} of the {used.group(2)} available: {used.group(3)} over"
  raise OutOfMemoryError(
    f"the train step does not fit in {device_kind} memory:{detail or ' ' + error[:300]}. To fit: {_advice(config)}."
  )


def _gib(size: str) -> float:
  value, unit = re.match(r"([0-9.]+)\s*([KMGT]?)", size).groups()
  return float(value) * 1024.0 ** ("KMGT".index(unit) + 1 if unit else 0) / GiB


def check_fits(config: Config, report: CompileReport, platform: str) -> str | None:
  """XLA:TPU refuses a program that does not fit in HBM at compile time; XLA:GPU does not, so a GPU
  target is checked against the table's memory here. Returns a note for a TPU sum above its HBM."""
  if not report.hbm_bytes or report.total_bytes <= report.hbm_bytes:
    return None
  if platform == "tpu":
    return "note: XLA:TPU checked HBM and accepted the program; buffers above are not all live at the same time"
  over = (report.total_bytes - report.hbm_bytes) / GiB
  raise OutOfMemoryError(
    f"the train step needs {report.total_bytes / GiB:.2f} GiB per device, {over:.2f} GiB over the "
    f"{report.hbm_bytes / GiB:.0f} GiB of {report.device_kind}. To fit: {_advice(config)}."
  )


def _total_or_none(config: Config, devices: Sequence[Any]) -> float | None:
  """auto_fit's probe: XLA's total bytes per device for `config`, None where XLA refuses it for memory."""
  try:
    return compile_train_step(config, devices)[1].total_bytes
  except OutOfMemoryError:
    return None


def print_other_programs(config: Config, devices: Sequence[Any], mesh: Mesh) -> None:
  """An objective's programs besides the train step (its optional aot_programs hook: GRPO's sampler), one report
  each, then its notes (aot_notes)."""
  objective = objectives.get(config)
  if not hasattr(objective, "aot_programs"):
    return
  with sharding.activate(config, mesh):
    spec = state_lib.param_spec(config, mesh, planner.build(config, mesh))
    rows = sharding.global_batch_size(config, mesh)
    for name, (compiled, seconds) in objective.aot_programs(config, mesh, spec.abstract, rows).items():
      print(f"{name}: {format_report(compile_report(compiled, devices, mesh, seconds))}", flush=True)
  for line in objective.aot_notes(config, devices):
    print(line, flush=True)


def checksum_line(config: Config, devices: Sequence[Any], mesh: Mesh) -> str:
  """What computing a checkpoint's checksums (checksums.py, at each save and resume) needs per device, beside the
  state it reads where it lies."""
  tx = optimizers.build(config).tx
  with sharding.activate(config, mesh):
    spec = state_lib.state_spec(config, tx, mesh, planner.build(config, mesh))
    try:
      memory = checksums.lowered(spec.partition.checkpointed(spec.abstract)).compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 (a side figure: the train step's report above stands)
      return f"checkpoint checksums: not compiled ({' '.join(str(e).split())[:200]})"
  mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
  return (
    f"checkpoint checksums: per device, temporaries {mib(memory.temp_size_in_bytes)} beside the saved state's "
    f"{mib(memory.argument_size_in_bytes)} (read in place; outputs {memory.output_size_in_bytes:,} bytes)"
  )


USAGE = launch.Usage(
  command="python3 MaxText/train_compile.py MaxText/configs/base.yml compile_topology=v5e-256 "
  "[compile_topology_num_slices=2] [compiled_trainstep_file=step.pickle] [key=value ...]",
  summary="Compile the real train step ahead of time for a topology and report its memory per device.",
  keys=(
    "compile_topology", "compile_topology_num_slices", "compiled_trainstep_file", "model_name",
    "per_device_batch_size", "max_target_length", "remat_policy", "ici_fsdp_parallelism", "dcn_data_parallelism",
    "auto_fit", "auto_fit_margin", "auto_fit_output",
  ),
)  # fmt: skip


def main(argv: Sequence[str], usage: launch.Usage = USAGE, overrides: Sequence[str] = ()) -> None:
  """argv: sys.argv (the program name first); `overrides` go after it (python3 -m MaxText.rl: objective=grpo)."""
  # One process compiles for the whole topology: it joins no job (and so claims no TPU chips).
  config = launch.start(argv[1:], usage, overrides=overrides, join_job=False)
  # A config, storage (compiled_trainstep_file on gs://) or data mistake exits with launch's one line.
  with launch.user_errors():
    launch.check_output_file("compiled_trainstep_file", config.compiled_trainstep_file, "train_step.pkl")  # pre-compile
    devices = topology_devices(config)
    if config.auto_fit:  # search layouts instead of compiling this one (autofit.py)
      autofit.run(config, argv[1:], devices, lambda c: _total_or_none(c, devices))
      return
    try:  # from XLA's compile or from check_fits: every line of the message is useful, so not one_line
      compiled, report, mesh = compile_train_step(config, devices)
      print(format_report(report), flush=True)
      note = check_fits(config, report, devices[0].platform)
    except OutOfMemoryError as e:
      sys.exit(f"Out of memory: {e}")
    if note:
      print(note, flush=True)
    print_other_programs(config, devices, mesh)
    print(checksum_line(config, devices, mesh), flush=True)
    hlo_dump.publish(config, is_writer=True)
    if config.compiled_trainstep_file:
      compiled_step.save_compiled(config.compiled_trainstep_file, compiled, config, mesh)
      print(f"saved the compiled train step to {config.compiled_trainstep_file}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
