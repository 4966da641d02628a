"""Write and read an orbax params checkpoint one slice at a time, so a conversion never holds the model.

A StreamedArray stands for a parameter that is not in memory: its shape, dtype and a list of
(index prefix, loader) pairs; each loader returns one slice (a layer, or one expert of a layer). An
orbax type handler registered for StreamedArray creates the parameter's tensorstore array with chunks
of exactly one slice and writes the slices parameter after parameter, up to WRITE_BUDGET_BYTES of them at once
(a tiny model's hundreds of small slices do not each wait for their commit, and a large model's layers overlap
their writes). Peak host memory is then that budget plus tensorstore's write buffers, whatever the model's size.

Reader opens each array of an existing orbax checkpoint with tensorstore and reads one block (a
layer of a stacked parameter, or a whole per-layer parameter) at a time, for the export to Hugging Face.

The checkpoint is an ordinary orbax PyTree checkpoint: the arrays are stored as the numpy handler
stores them (value type 'np.ndarray'), so it restores through the usual path (load_parameters_path)
into any sharding, and orbax's temporary-directory-then-rename commit keeps a crash from leaving a
half-written checkpoint behind. The handler uses orbax's tensorstore spec builder (an internal module;
orbax is pinned in requirements.txt and MaxText/tests/convert_streaming_test.py restores what it wrote).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.multihost import multihost
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from MaxText import checkpointing, paths


@dataclasses.dataclass(frozen=True)
class StreamedArray:
  """A parameter written slice by slice: `slices` cover it, each (index prefix, loader of that slice)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  slices: tuple[tuple[tuple[int, ...], Callable[[], np.ndarray]], ...]

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def chunk_shape(self) -> tuple[int, ...]:
    """One slice: 1 along the indexed (layer/expert) axes, the whole extent of the others."""
    k = max((len(index) for index, _ in self.slices), default=0)
    return (1,) * k + tuple(self.shape[k:])

  def uncovered(self) -> int:
    """How many elements no slice writes (0 for a complete parameter)."""
    covered = sum(int(np.prod(self.shape[len(index) :])) for index, _ in self.slices)
    return self.size - covered


# Bytes of slices in flight before the writer waits for them. Measured (benchmarks/convert_benchmark.py's 0.39 GB
# Llama, scanned): peak RSS grew 83 MiB writing one slice at a time, 125 MiB at 16 MiB, 297 MiB at 64 MiB.
WRITE_BUDGET_BYTES = 16 << 20


class StreamedArrayHandler(ocp.type_handlers.NumpyHandler):
  """Serializes StreamedArrays: creates each array with one-slice chunks and writes it slice by slice."""

  async def serialize(self, values: Sequence[StreamedArray], infos, args=None) -> list[future.Future]:
    args = args or [ocp.SaveArgs()] * len(values)
    return [future.CommitFutureAwaitingContractedSignals(self._write(values, infos, args), name="streamed_array")]

  async def _write(self, values: Sequence[StreamedArray], infos, args) -> None:
    in_flight, in_flight_bytes = [], 0  # slices being written: a tiny model's many small ones need not wait in turn
    for value, info, arg in zip(values, infos, args):
      await info.await_path_creation()
      spec = ts_utils.build_array_write_spec(
        info=info,
        arg=arg,
        global_shape=value.shape,
        local_shape=value.chunk_shape,
        dtype=value.dtype,
        use_ocdbt=info.is_ocdbt_checkpoint,
        process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
      )
      if multihost.process_index() != 0:
        continue
      array = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
      for index, load in value.slices:
        data = np.asarray(load(), dtype=value.dtype)
        in_flight.append(array[index].write(data))
        in_flight_bytes += data.nbytes
        if in_flight_bytes >= WRITE_BUDGET_BYTES:
          await asyncio.gather(*in_flight)
          in_flight, in_flight_bytes = [], 0
    await asyncio.gather(*in_flight)


def _register() -> None:
  """Register the handler without orbax's warning that it shares np.ndarray's typestr: it does on purpose (the
  arrays are read back as numpy arrays), and a user could do nothing about the line on every conversion."""
  absl = logging.getLogger("absl")
  quiet = lambda record: "collision on np.ndarray" not in record.getMessage()
  absl.addFilter(quiet)
  try:
    ocp.type_handlers.register_type_handler(StreamedArray, StreamedArrayHandler(), override=True)
  finally:
    absl.removeFilter(quiet)


_register()


def save(path: str, tree: Any) -> None:
  """Write `tree` (StreamedArray leaves, and/or ordinary arrays) as an orbax PyTree checkpoint at `path`."""
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(paths.absolute(path), args=ocp.args.PyTreeSave(tree))


class Reader:
  """Blocks of the arrays of an orbax PyTree checkpoint, read with tensorstore (no whole-model restore).

  `keys` holds every array's key path (tuple of str). read(key, index) returns array[index]; it reads
  the block array[index[:block_axes]] and keeps the most recent block, so the experts of one layer
  cost one read of that layer.
  """

  def __init__(self, path: str):
    self.path = paths.absolute(path)  # local or gs:// (tensorstore reads both)
    tree = checkpointing.saved_tree(self.path)
    self.keys = {tuple(str(key_name(k)) for k in key) for key, _ in jax.tree_util.tree_leaves_with_path(tree)}
    flags = json.loads(paths.Path(paths.join(self.path, "_METADATA")).read_text())
    self._ocdbt, self._zarr3 = flags.get("use_ocdbt", True), flags.get("use_zarr3", False)
    self._context = ts_utils.get_ts_context(use_ocdbt=self._ocdbt)
    self._block: tuple[Any, np.ndarray] | None = None

  def read(self, key: tuple[str, ...], index: tuple[int, ...], block_axes: int) -> np.ndarray:
    block_index = index[:block_axes]
    if self._block is None or self._block[0] != (key, block_index):
      spec = ts_utils.ArrayReadSpec(
        directory=self.path, relative_array_filename=".".join(key), use_zarr3=self._zarr3, use_ocdbt=self._ocdbt
      )
      array = ts.open(ts.Spec(spec.json), open=True, context=self._context).result()
      self._block = None  # free the previous block before reading the next
      self._block = ((key, block_index), array[block_index].read().result())
    return self._block[1][index[block_axes:]]


def key_name(entry: Any) -> Any:
  """A jax key-path entry -> its key."""
  return getattr(entry, "key", getattr(entry, "idx", entry))
