"""The streaming checkpoint writer (MaxText/convert/streaming.py) and the converter's peak memory."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from benchmarks import convert_benchmark
from MaxText import checkpointing
from MaxText.convert import streaming


def test_streamed_arrays_restore_exactly(tmp_path):
  """Slices indexed by (layer, expert), by layer, and a whole array come back in place."""
  rng = np.random.default_rng(0)
  experts = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
  layers = rng.standard_normal((3, 6)).astype(np.float32)
  whole = rng.standard_normal((7, 4)).astype(np.float32)
  tree = {
    "params": {
      "experts": streaming.StreamedArray(
        experts.shape,
        np.dtype(np.float32),
        tuple(((i, e), lambda i=i, e=e: experts[i, e]) for i in range(3) for e in range(2)),
      ),
      "layers": streaming.StreamedArray(
        layers.shape, np.dtype(np.float32), tuple(((i,), lambda i=i: layers[i]) for i in range(3))
      ),
      "whole": streaming.StreamedArray(whole.shape, np.dtype(np.float32), (((), lambda: whole),)),
    }
  }
  assert tree["params"]["experts"].chunk_shape == (1, 1, 4, 5)
  assert all(a.uncovered() == 0 for a in tree["params"].values())
  path = os.path.join(tmp_path, "ckpt")
  streaming.save(path, tree)
  restore_args = {"params": {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in tree["params"]}}
  got = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))["params"]
  for name, want in (("experts", experts), ("layers", layers), ("whole", whole)):
    np.testing.assert_array_equal(got[name], want)


@pytest.mark.slow  # over 40 s on 2 busy cores (2026-11-27)
def test_conversion_memory_stays_far_below_the_model_size(tmp_path):
  """A 0.39 GB Llama (24 layers, largest tensor 8 MB) converts to MaxText (scanned and unrolled) and
  back with peak RSS growth under half the model (the former whole-model converters grew by 2-3x the
  model), and restores exactly."""
  hf = os.path.join(tmp_path, "hf")
  total, largest = convert_benchmark.write_llama(hf, layers=24, emb=512, mlp=2048, vocab=4096, heads=8)
  for scan in (True, False):
    out = os.path.join(tmp_path, f"out_{scan}")
    r = convert_benchmark.measure(hf, out, scan)
    growth = (r["after_kb"] - r["before_kb"]) * 1024
    assert growth < total / 2, (
      f"scan_layers={scan}: peak RSS grew {growth / 2**20:.0f} MiB for a {total / 2**20:.0f} MiB model"
    )
    if scan:
      r = convert_benchmark.measure(out, os.path.join(tmp_path, "back"), scan, "export")
      growth = (r["after_kb"] - r["before_kb"]) * 1024
      assert growth < total / 2, f"export: peak RSS grew {growth / 2**20:.0f} MiB for a {total / 2**20:.0f} MiB model"
  from safetensors.numpy import load_file  # noqa: PLC0415

  path = os.path.join(tmp_path, "out_True", "params")
  args = {"params": _numpy_args(checkpointing.saved_tree(path)["params"])}
  params = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=args))["params"]
  shard = load_file(os.path.join(hf, "model-00001-of-00002.safetensors"))
  layer = params["layers"]
  np.testing.assert_array_equal(
    layer["mlp"]["wo"]["kernel"]["value"][20], shard["model.layers.20.mlp.down_proj.weight"].T
  )
  assert largest == 4096 * 512 * 4
  index = json.load(open(os.path.join(tmp_path, "back", "model.safetensors.index.json")))["weight_map"]
  name = "model.layers.20.mlp.down_proj.weight"
  np.testing.assert_array_equal(load_file(os.path.join(tmp_path, "back", index[name]))[name], shard[name])


def _numpy_args(tree):
  if isinstance(tree, dict):
    return {k: _numpy_args(v) for k, v in tree.items()}
  return ocp.RestoreArgs(restore_type=np.ndarray)


def test_the_converters_log_no_warning_a_user_cannot_act_on(tmp_path):
  """Importing the streaming writer (orbax: its handler shares np.ndarray's typestr, on purpose) and reading the
  tree of a training checkpoint's item directory (orbax: no _CHECKPOINT_METADATA there, by design) print nothing."""
  imported = subprocess.run([sys.executable, "-c", "import MaxText.convert.streaming"], capture_output=True, text=True)
  assert imported.returncode == 0 and "WARNING" not in imported.stderr, imported.stderr
  item = os.path.join(tmp_path, "checkpoints", "1", "state")  # as a train run lays it out
  ocp.PyTreeCheckpointer().save(item, {"params": {"w": np.ones((2, 3), np.float32)}})
  if os.path.exists(os.path.join(item, "_CHECKPOINT_METADATA")):  # a step's item directory has none
    os.remove(os.path.join(item, "_CHECKPOINT_METADATA"))
  seen = []
  handler = logging.Handler()
  handler.emit = seen.append
  logging.getLogger("absl").addHandler(handler)
  try:
    tree = streaming.Reader(item).keys
  finally:
    logging.getLogger("absl").removeHandler(handler)
  assert tree == {("params", "w")} and not [r.getMessage() for r in seen if r.levelno >= logging.WARNING]
