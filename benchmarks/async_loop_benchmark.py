"""Host overhead hidden by the asynchronous train loop. A table, not a timed test.

  python3 benchmarks/async_loop_benchmark.py [steps=30] [delays=0,20,40] [rounds=2] [key=value ...]

A tiny model (2 layers, 128 wide, vocabulary 1,024, batch 4 x 64 on one CPU device) trained by the real
`train.train_loop` on synthetic data behind a wrapper that sleeps `delay` ms per batch: a stand-in for a
slow input pipeline (tokenising, packing, reading). Two loops over the same step function:

  sync   the old behaviour: the host waits for every step before it does anything else (the step
         function blocks on its outputs), so each step costs compute + input time;
  async  train.py as it is: step N+1 is dispatched before step N's metrics are read and batch N+1 is
         fetched while step N runs, so a step costs about max(compute, input time).

Reports the loop's own mean step_time_s (compile steps excluded), best of `rounds` runs per cell.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import jax

from MaxText import accelerators, checkpointing, config, launch, optimizers, sharding, train
from MaxText import data as data_lib
from MaxText import state as state_lib

MODEL = [
  "dataset_type=synthetic",
  "base_emb_dim=128",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "base_mlp_dim=256",
  "base_num_decoder_layers=2",
  "head_dim=32",
  "vocab_size=1024",
  "max_target_length=64",
  "per_device_batch_size=4",
  "dtype=float32",
  "log_config=false",
  "log_period=1000",
  "enable_checkpointing=false",
  "enable_tensorboard=false",
]
OWN_ARGS = {"steps": "30", "delays": "0,20,40", "rounds": "2"}


class SlowBatches:
  """A train iterator that sleeps `delay_s` before each batch: host-side input work the device could overlap."""

  def __init__(self, inner: Any, delay_s: float):
    self.inner, self.delay_s = inner, delay_s

  def __iter__(self) -> SlowBatches:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    time.sleep(self.delay_s)
    return next(self.inner)

  def get_state(self) -> dict[str, Any]:
    return self.inner.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self.inner.set_state(state)


def blocking(step_fn: Any) -> Any:
  """The step function, waiting for its outputs: the host cannot run ahead of the device (the old loop)."""

  def step(state, batch, rng):
    return jax.block_until_ready(step_fn(state, batch, rng))

  return step


def mean_step_time(c: config.Config, delay_ms: float, sync: bool) -> float:
  """train_loop's mean step_time_s (s) for one fresh run of c.steps steps."""
  mesh = sharding.create_mesh(c, jax.devices()[:1])
  optimizer = optimizers.build(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, optimizer.tx, mesh)
    data = data_lib.make_iterators(c, mesh)
    data = data._replace(train=SlowBatches(data.train, delay_ms / 1000))
    restored = checkpointing.Restored(state_lib.init_state(c, optimizer.tx, spec), None, "init")
    step_fn = train.train_step_fn(c, mesh, optimizer, spec)
    step_fn = blocking(step_fn) if sync else step_fn
    batch = sharding.global_batch_size(c, mesh)
    peak = accelerators.Peak(1e12, "fixed for this benchmark")
    parts = train.LoopParts(mesh, spec, restored, data, None, step_fn, batch, peak, started=time.perf_counter())
    return train.train_loop(c, parts)["mean_step_time_s"]


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  launch.doc_help(argv[1:], __doc__)
  own = dict(OWN_ARGS)
  rest = []
  for arg in argv[1:]:
    key = arg.split("=", 1)[0]
    if key in own:
      own[key] = arg.split("=", 1)[1]
    else:
      rest.append(arg)
  delays = [float(d) for d in own["delays"].split(",")]
  out = tempfile.mkdtemp(prefix="async_loop_")
  base = os.path.join(config.CONFIG_DIR, "base.yml")
  c = config.load([base, "run_name=async_bench", f"base_output_directory={out}", *MODEL, f"steps={own['steps']}"]
                  + rest, {})  # fmt: skip
  rows = []
  for delay in delays:
    times = {}
    for mode in ("sync", "async"):
      times[mode] = min(mean_step_time(c, delay, mode == "sync") for _ in range(int(own["rounds"])))
    rows.append((delay, times["sync"], times["async"]))
  print(f"\n{c.steps} steps per run (the 2 compile steps excluded), best of {own['rounds']} runs")
  print("| input delay (ms/batch) | sync loop (ms/step) | async loop (ms/step) | async / sync |")
  print("|---|---|---|---|")
  for delay, sync_s, async_s in rows:
    print(f"| {delay:g} | {1e3 * sync_s:.1f} | {1e3 * async_s:.1f} | {async_s / sync_s:.2f} |")


if __name__ == "__main__":
  main(sys.argv)
