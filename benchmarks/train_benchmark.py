"""Training throughput of a ~110M-parameter Llama-style model: a table, not a timed test.

  python3 benchmarks/train_benchmark.py [key=value ...]     # overrides apply on top of BENCHMARK

Compiles the real train step (MaxText.train_step.jit_train_step) once, times `steps` steps on
synthetic data after `warmup` steps, and prints tokens/s/device, TFLOP/s/device, MFU (6·N·T +
unembedding + causal attention FLOPs over the device peak; on CPU a measured matmul peak), compile
time, the compiled program's memory and the process's peak resident memory.
"""

from __future__ import annotations

import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from MaxText import accelerators, config, metrics, optimizers, sharding  # noqa: E402
from MaxText import data as data_lib  # noqa: E402
from MaxText import state as state_lib  # noqa: E402
from MaxText import train_step as steps  # noqa: E402

BENCHMARK = [
  "run_name=train_benchmark",
  "base_output_directory=/tmp/maxtext_benchmarks",
  "dataset_type=synthetic",
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
  "log_config=false",
  "enable_checkpointing=false",
]
MiB = 2**20


def measure(c: config.Config, warmup: int = 2, timed: int = 5) -> dict:
  mesh = sharding.create_mesh(c)
  batch = sharding.global_batch_size(c, mesh)
  tx, schedule = optimizers.build(c)
  peak = accelerators.peak_flops_per_device()
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    state = state_lib.init_state(c, tx, spec)
    batches = data_lib.make_iterators(c, mesh).train
    step_fn = steps.jit_train_step(c, mesh, tx, spec, schedule)
    first = next(batches)
    t0 = time.perf_counter()
    compiled = step_fn.lower(state, first, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
      state, m = compiled(state, next(batches), jax.random.key(i))
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(timed):
      state, m = compiled(state, next(batches), jax.random.key(i))
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t0) / timed
  tokens = batch * c.max_target_length
  flops = metrics.training_flops_per_token(c).total * tokens
  mem = compiled.memory_analysis()
  program_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes if mem else 0
  return {
    "params": spec.num_params,
    "devices": mesh.size,
    "global batch": f"{batch} x {c.max_target_length}",
    "step time (s)": step_s,
    "tokens/s/device": tokens / step_s / mesh.size,
    "TFLOP/s/device": flops / step_s / mesh.size / 1e12,
    "peak TFLOP/s/device": peak / 1e12,
    "MFU": metrics.mfu(flops, step_s, mesh.size, peak),
    "compile time (s)": compile_s,
    "program memory/device (MiB)": program_bytes / MiB,
    "peak RSS (MiB)": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  }


def table(result: dict) -> str:
  def fmt(key, v):
    if key == "MFU":
      return f"{v:.1%}"
    if isinstance(v, float):
      return f"{v:,.4g}"
    return f"{v:,}" if isinstance(v, int) else str(v)

  rows = [f"| {k} | {fmt(k, v)} |" for k, v in result.items()]
  return "\n".join(["| metric | value |", "|---|---|", *rows])


def main(argv: list[str]) -> None:
  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), *BENCHMARK, *argv[1:]])
  print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()} | jax {jax.__version__}")
  print(table(measure(c)))


if __name__ == "__main__":
  main(sys.argv)
