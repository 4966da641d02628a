"""Training throughput on this host's devices: a table, not a timed test.

  python3 benchmarks/train_benchmark.py [key=value ...]     # overrides apply on top of BENCHMARK + TRAIN
  python3 benchmarks/train_benchmark.py --config=MaxText/configs/quickstart.yml --sweep [key=value ...]

Compiles the real train step (MaxText.train_step.jit_train_step) once, times `--timed` steps on
synthetic data after `--warmup` steps, and prints tokens/s/device, TFLOP/s/device, MFU (6·N·T +
unembedding + causal attention FLOPs over the device peak; on CPU a measured matmul peak), compile
time, the compiled program's memory and the process's peak resident memory.

Flags (before the key=value overrides):
  --config=FILE   benchmark FILE's model (dataset_type=synthetic forced) instead of BENCHMARK's ~110M one
  --sweep         every dtype x remat_policy in SWEEP, each compiled once, then timed in `--rounds`
                  interleaved rounds (A, B, C, A, B, C, ...) so load from other jobs on a shared host
                  falls on every setting alike; prints the median step time of each
  --warmup=N --timed=N --rounds=N   steps before timing, steps per timing, rounds of a sweep
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

import jax

from MaxText import accelerators, config, flops, launch, optimizers, sharding
from MaxText import data as data_lib
from MaxText import state as state_lib
from MaxText import train_step as steps

# Keys every run gets: synthetic data, no files written but the (unused) run directory.
HARNESS = [
  "run_name=train_benchmark",
  "base_output_directory=/tmp/maxtext_benchmarks",
  "dataset_type=synthetic",
  "log_config=false",
  "enable_checkpointing=false",
]
BENCHMARK = [
  *HARNESS,
  "base_emb_dim=768",
  "base_num_query_heads=12",
  "base_num_kv_heads=12",
  "head_dim=64",
  "base_mlp_dim=2048",
  "base_num_decoder_layers=12",
  "vocab_size=16384",
  "max_target_length=512",
  "per_device_batch_size=4",
  "dtype=float32",
  "remat_policy=none",
]
# The training benchmark's own settings, on top of BENCHMARK (whose float32 the decode benchmark keeps
# for parity with Hugging Face's float32): the fastest measured on a 2-core AVX512-BF16/AMX CPU
# (benchmarks/README.md, "dtype x remat_policy on CPU").
TRAIN = ["dtype=bfloat16", "remat_policy=full"]
SWEEP = {"dtype": ["float32", "bfloat16"], "remat_policy": ["none", "full", "minimal"]}
MiB = 2**20


@dataclasses.dataclass
class Run:
  """One compiled train step with its live state: `advance` steps it and times it."""

  compiled: Any
  state: Any
  batches: Iterator
  tokens: int  # per step, all devices
  flops: float  # model FLOPs per step, all devices
  devices: int
  params: int
  compile_s: float
  step: int = 0

  def advance(self, n: int) -> float:
    """Run n steps; mean wall seconds per step (dispatch to the last step's metrics being ready)."""
    t0 = time.perf_counter()
    for _ in range(n):
      self.state, m = self.compiled(self.state, next(self.batches), jax.random.key(self.step))
      self.step += 1
    jax.block_until_ready(m)
    return (time.perf_counter() - t0) / n


def prepare(c: config.Config) -> Run:
  """Build the state and data of `c` and compile its real train step (not yet run)."""
  mesh = sharding.create_mesh(c)
  tx, schedule = optimizers.build(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    state = state_lib.init_state(c, tx, spec)
    batches = data_lib.make_iterators(c, mesh).train
    step_fn = steps.jit_train_step(c, mesh, tx, spec, schedule)
    first = next(batches)
    t0 = time.perf_counter()
    compiled = step_fn.lower(state, first, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t0
  tokens = sharding.global_batch_size(c, mesh) * c.max_target_length
  step_flops = flops.training_flops_per_token(c, flops.abstract_model(c, spec)).total * tokens
  return Run(compiled, state, batches, tokens, step_flops, mesh.size, spec.num_params, compile_s)


def measure(c: config.Config, warmup: int = 2, timed: int = 5) -> dict:
  """The table's metrics for `c`: one compile, `warmup` untimed steps, the mean of `timed` steps."""
  run = prepare(c)
  run.advance(warmup)
  step_s = run.advance(timed)
  peak = accelerators.peak_flops_per_device(dtype=c.dtype)  # as train.py reports MFU
  mem = run.compiled.memory_analysis()
  program_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes if mem else 0
  batch = run.tokens // c.max_target_length
  return {
    "params": run.params,
    "devices": run.devices,
    "global batch": f"{batch} x {c.max_target_length}",
    "dtype / remat_policy": f"{c.dtype} / {c.remat_policy}",
    "step time (s)": step_s,
    "tokens/s/device": run.tokens / step_s / run.devices,
    "TFLOP/s/device": run.flops / step_s / run.devices / 1e12,
    "peak TFLOP/s/device": peak / 1e12,
    "MFU": flops.mfu(run.flops, step_s, run.devices, peak),
    "compile time (s)": run.compile_s,
    "program memory/device (MiB)": program_bytes / MiB,
    "peak RSS (MiB)": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  }


def sweep(argv: list[str], warmup: int, timed: int, rounds: int) -> list[dict]:
  """Median step time of every SWEEP setting over `rounds` interleaved timings of `timed` steps.

  MFU is against the host's best measured matmul (the larger of the float32 and bfloat16 peaks), one
  reference for every row, so it ranks settings the way tokens/s does.
  """
  settings = [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())]
  runs = []
  for s in settings:
    run = prepare(config.load([*argv, *(f"{k}={v}" for k, v in s.items())]))
    run.advance(warmup)
    runs.append(run)
  times = [[] for _ in runs]
  for _ in range(rounds):
    for run, t in zip(runs, times):
      t.append(run.advance(timed))
  peak = max(accelerators.peak_flops_per_device(dtype=d) for d in SWEEP["dtype"])
  rows = []
  for s, run, t in zip(settings, runs, times):
    step_s = statistics.median(t)
    rows.append(
      {
        **s,
        "step time (s)": step_s,
        "spread (s)": f"{min(t):.3f}-{max(t):.3f}",
        "tokens/s/device": run.tokens / step_s / run.devices,
        "MFU": flops.mfu(run.flops, step_s, run.devices, peak),
        "compile time (s)": run.compile_s,
      }
    )
  return rows


def _fmt(key: str, v: Any) -> str:
  if key == "MFU":
    return f"{v:.1%}"
  if isinstance(v, float):
    return f"{v:,.4g}"
  return f"{v:,}" if isinstance(v, int) else str(v)


def table(result: dict) -> str:
  """Two-column Markdown table of one measure() result."""
  rows = [f"| {k} | {_fmt(k, v)} |" for k, v in result.items()]
  return "\n".join(["| metric | value |", "|---|---|", *rows])


def sweep_table(rows: list[dict]) -> str:
  """Markdown table of sweep() rows, one per setting, fastest first."""
  rows = sorted(rows, key=lambda r: r["step time (s)"])
  head = list(rows[0])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(_fmt(k, r[k]) for k in head) + " |" for r in rows]
  return "\n".join(lines)


def _flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
  """Split `--name[=value]` flags from key=value overrides."""
  flags = dict(a[2:].partition("=")[::2] for a in argv if a.startswith("--"))
  unknown = set(flags) - {"config", "sweep", "warmup", "timed", "rounds"}
  if unknown:
    raise SystemExit(f"unknown flag(s) {sorted(unknown)}: see this script's docstring for --config, --sweep, ...")
  return flags, [a for a in argv if not a.startswith("--")]


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  launch.doc_help(argv[1:], __doc__)
  flags, overrides = _flags(argv[1:])
  base = (
    [flags["config"], *HARNESS]
    if "config" in flags
    else [os.path.join(config.CONFIG_DIR, "base.yml"), *BENCHMARK, *TRAIN]
  )
  warmup, timed = int(flags.get("warmup", 2)), int(flags.get("timed", 5))
  print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()} | jax {jax.__version__}")
  if "sweep" in flags:
    rounds = int(flags.get("rounds", 5))
    print(sweep_table(sweep([*base, *overrides], warmup, timed, rounds)))
    print(f"median of {rounds} interleaved rounds of {timed} steps after {warmup} warm-up steps")
  else:
    print(table(measure(config.load([*base, *overrides]), warmup, timed)))


if __name__ == "__main__":
  main(sys.argv)
