"""What checkpoint checksums cost: save and restore of a train state with and without them. A table, not a test.

  python3 benchmarks/checkpoint_cost.py [layers=1] [repeats=3] [aot=v5e-256,...] [key=value ...]

A llama2-7b-shaped state (4,096 wide, MLP 11,008, 32 heads, vocabulary 32,000; bfloat16 params and AdamW
moments, weight_dtype=bfloat16) with `layers` decoder layers, on the host's CPU devices, saved and restored
through orbax as a run does (synchronous saves, so a save's time is all of its work). Per layer count:

  digests     checksums.digests of the state (what a save adds; compile excluded, reported apart)
  save        checkpointing.save without / with the `checksums` item, until the step is committed
  restore     the state and data items read back into the sharded layout
  verify      checksums.verify of the restored state against the saved table (what a restore adds)

With `aot`, also the checksum program of the whole 32-layer state compiled for each TPU topology named (needs
libtpu; nothing runs): its temporaries per chip, as train_compile.py prints them.

Given two or more layer counts (layers=1,2), a 32-layer row extrapolated from the first two (every figure but the
compile is linear in the layers). On CPU the digest program holds about 4x the state in temporaries (XLA:CPU
materializes the widened words and weights; a TPU compile fuses them: the aot line), so a 7B-wide state of more
than one layer needs more than this 24 GiB machine shares.
Restores read files just written, so they come from the page cache: a cold read from a disk or a bucket is
slower, and the checksum's share of it smaller.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from MaxText import checkpointing, checksums, config, optimizers, sharding, train_compile
from MaxText import state as state_lib

MODEL = [
  "model_name=llama2-7b",
  "override_model_config=true",
  "weight_dtype=bfloat16",
  "dtype=bfloat16",
  "per_device_batch_size=1",
  "max_target_length=128",
  "dataset_type=synthetic",
  "enable_checkpointing=true",
  "async_checkpointing=false",
  "log_config=false",
]
FULL_LAYERS = 32
COLUMNS = ("digests", "save", "save+checksums", "restore", "verify")


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def _median(fn, repeats: int) -> float:
  return statistics.median(_timed(fn) for _ in range(repeats))


def measure(layers: int, repeats: int, overrides: list[str], root: str) -> dict[str, Any]:
  """One row: GiB of the state and the median seconds of each COLUMNS step."""
  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), f"run_name=l{layers}", f"base_output_directory={root}"]
                  + MODEL + [f"base_num_decoder_layers={layers}", *overrides], {})  # fmt: skip
  tx = optimizers.build(c).tx
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    state = jax.block_until_ready(state_lib.init_state(c, tx, spec))
    data_state = {"step": 0}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    compile_s = _timed(lambda: checksums.digests(state))  # the first call compiles the digest program
    row: dict[str, Any] = {"layers": layers, "GiB": nbytes / 2**30, "digest compile": compile_s}
    row["digests"] = _median(lambda: checksums.digests(state), repeats)

    plain = ocp.CheckpointManager(os.path.join(root, f"plain{layers}"), item_names=("state", "data"))
    manager = checkpointing.create_manager(c)
    step = iter(range(1, 10 * repeats))

    def save_plain():
      args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
      plain.save(next(step), args=args, force=True)
      plain.wait_until_finished()

    def save_checked():
      checkpointing.save(manager, next(step), state, data_state)
      checkpointing.wait_for_saves(manager)

    row["save"] = _median(save_plain, repeats)
    row["save+checksums"] = _median(save_checked, repeats)
    last = manager.latest_step()
    jax.tree.map(lambda x: x.delete(), state)  # one state in memory at a time
    args = ocp.args.Composite(state=ocp.args.StandardRestore(spec.abstract), data=ocp.args.JsonRestore())
    restored = {}

    def restore():
      restored.clear()
      restored["it"] = manager.restore(last, args=args)
      jax.block_until_ready(restored["it"].state)

    row["restore"] = _median(restore, repeats)
    step_dir = os.path.join(c.checkpoint_dir, str(last))
    row["verify"] = _median(lambda: checksums.verify(step_dir, restored["it"].state, "bench"), repeats)
    plain.close()
    checkpointing.finish(manager)
  return row


def extrapolated(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """The FULL_LAYERS row of a straight line through the first two rows."""
  a, b = rows[0], rows[1]
  scale = (FULL_LAYERS - a["layers"]) / (b["layers"] - a["layers"])
  keys = ("GiB", *COLUMNS)  # the compile is not: scanned layers are one stacked array whatever their count
  line = {k: a[k] + (b[k] - a[k]) * scale for k in keys}
  return {"layers": f"{FULL_LAYERS} (extrapolated)", "digest compile": None, **line}


def table(rows: list[dict[str, Any]]) -> str:
  head = "| layers | state GiB | digest compile s | digests s | save s | save + checksums s | restore s | verify s |"
  lines = [head, "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    compile_s = "-" if r["digest compile"] is None else f"{r['digest compile']:.2f}"
    cells = [f"{r['GiB']:.2f}", compile_s, *(f"{r[k]:.2f}" for k in COLUMNS)]
    lines.append(f"| {r['layers']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def aot(topologies: list[str], overrides: list[str], root: str) -> None:
  """train_compile.py's checksum line for the whole model on each topology."""
  for name in topologies:
    argv = [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=aot", f"base_output_directory={root}", *MODEL]
    c = config.load([*argv, f"compile_topology={name}", *overrides], {})
    devices = train_compile.topology_devices(c)
    print(f"{name}: {train_compile.checksum_line(c, devices, sharding.create_mesh(c, devices))}", flush=True)


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  ours = ("layers", "repeats", "aot")
  options = dict(a.split("=", 1) for a in argv[1:] if a.split("=", 1)[0] in ours)
  overrides = [a for a in argv[1:] if a.split("=", 1)[0] not in ours]
  if options.get("aot"):
    aot(options["aot"].split(","), overrides, tempfile.mkdtemp(prefix="checkpoint_cost_"))
  layer_counts = [int(n) for n in options.get("layers", "1").split(",")]
  repeats = int(options.get("repeats", "3"))
  root = tempfile.mkdtemp(prefix="checkpoint_cost_")
  try:
    rows = []
    for layers in layer_counts:
      rows.append(measure(layers, repeats, overrides, root))
      shutil.rmtree(root, ignore_errors=True)
      print(table(rows[-1:]), flush=True)
    if len(rows) >= 2:
      rows.append(extrapolated(rows))
    print(table(rows))
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main(sys.argv)
