"""Input pipeline overhead: step time of the ~110M benchmark model (train_benchmark.BENCHMARK) on
dataset_type=grain (a prepared ArrayRecord corpus) against dataset_type=synthetic. A table, not a timed test.

  python3 benchmarks/data_benchmark.py [rounds=3] [steps=5] [key=value ...]

Prepares once, under /tmp/maxtext_benchmarks/data: the Python standard library's sources as ArrayRecord
(8 shards) and a SentencePiece tokenizer trained on them. Then compiles the real train step once and times
alternating rounds of `steps` steps on each dataset, each step synchronised as train.py does (it reads the
loss), so input time that is not hidden by grain's prefetching shows up in the step time. Reports medians.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
from train_benchmark import BENCHMARK  # beside this file: a script imports from its own directory

from MaxText import config, launch, optimizers, sharding
from MaxText import data as data_lib
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.data import text, tokenizer
from MaxText.data.convert_to_arrayrecord import write_arrayrecord

ROOT = "/tmp/maxtext_benchmarks/data"
OWN_ARGS = {"rounds": 3, "steps": 5}


def prepare_corpus() -> tuple[str, str]:
  """(ArrayRecord glob, tokenizer path), built once from the stdlib's sources."""
  records, model = os.path.join(ROOT, "records"), os.path.join(ROOT, "tokenizer", tokenizer.MODEL_FILE)
  if not os.path.isdir(records) or not os.path.isfile(model):
    docs = text.list_documents(config.load([os.path.join(config.CONFIG_DIR, "base.yml")], {}))
    texts = [text.read_document(p, strict=False) for p in docs.paths]
    tokenizer.train_sentencepiece(texts, 8192, os.path.dirname(model))
    write_arrayrecord(texts, records + ".tmp", num_shards=8)
    os.replace(records + ".tmp", records)
  return os.path.join(records, "data-*.array_record"), model


def time_steps(step_fn, state, batches, n: int):
  """Mean seconds per step over n steps, synchronising every step as train.py does."""
  t0 = time.perf_counter()
  for i in range(n):
    state, m = step_fn(state, next(batches), jax.random.key(i))
    float(m["loss"])
  return state, (time.perf_counter() - t0) / n


def input_seconds(batches, n: int = 20) -> float:
  """Mean seconds to produce one global batch on its devices, without training: the pipeline's own cost."""
  t0 = time.perf_counter()
  for _ in range(n):
    jax.block_until_ready(next(batches))
  return (time.perf_counter() - t0) / n


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  launch.doc_help(argv[1:], __doc__)
  args = argv[1:]
  own = {k: int(a.split("=", 1)[1]) for k in OWN_ARGS for a in args if a.startswith(f"{k}=")}
  rounds, n = own.get("rounds", OWN_ARGS["rounds"]), own.get("steps", OWN_ARGS["steps"])
  overrides = [a for a in args if a.split("=", 1)[0] not in OWN_ARGS]
  files, model = prepare_corpus()
  base = [os.path.join(config.CONFIG_DIR, "base.yml"), *BENCHMARK, *overrides]
  synthetic = config.load(base, {})
  grain = config.load([*base, "dataset_type=grain", f"grain_train_files={files}", f"tokenizer_path={model}"], {})
  mesh = sharding.create_mesh(synthetic)
  tx, schedule = optimizers.build(synthetic)
  with sharding.activate(synthetic, mesh):
    spec = state_lib.state_spec(synthetic, tx, mesh)
    state = state_lib.init_state(synthetic, tx, spec)
    # The same shapes and shardings for both datasets.
    step_fn = steps.jit_train_step(synthetic, mesh, tx, spec, schedule)
    iterators = {"synthetic": data_lib.make_iterators(synthetic, mesh).train}
    iterators["grain"] = data_lib.make_iterators(grain, mesh).train
    times = {name: [] for name in iterators}
    for batches in iterators.values():  # compile and warm up (grain: start its workers)
      state, _ = time_steps(step_fn, state, batches, 2)
    for _ in range(rounds):
      for name, batches in iterators.items():
        state, seconds = time_steps(step_fn, state, batches, n)
        times[name].append(seconds)
    inputs = {name: input_seconds(batches) for name, batches in iterators.items()}
  report(times, inputs, grain.grain_worker_count)


def report(times: dict, inputs: dict, workers: int) -> None:
  """A markdown table: median/min step times, each round, and the input pipeline's own time per batch."""
  med = {name: statistics.median(t) for name, t in times.items()}
  print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()} | grain_worker_count={workers}")
  print("| dataset_type | median step (s) | min step (s) | rounds (s) | input only (ms/batch) |")
  print("|---|---|---|---|---|")
  for name, t in times.items():
    rounds_s = ", ".join(f"{x:.3f}" for x in t)
    print(f"| {name} | {med[name]:.3f} | {min(t):.3f} | {rounds_s} | {1e3 * inputs[name]:.2f} |")
  ratio_min = min(times["grain"]) / min(times["synthetic"])
  print(f"grain / synthetic step time: median {med['grain'] / med['synthetic']:.3f}, min {ratio_min:.3f}")
  print(f"grain input time / synthetic step time: {inputs['grain'] / med['synthetic']:.4f}")


if __name__ == "__main__":
  main(sys.argv)
