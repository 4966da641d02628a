"""Rows -> training batches: targets and masks from segment ids, this process's rows, global jax.Arrays.

Every backend describes its data as an endless sequence of rows indexed by a global row number
n = 0, 1, 2, ...; batch k is rows [k * global_batch, (k + 1) * global_batch). A row is a pure function
of n (and the seed), so the global batch is the same whatever the number of processes, each process
builds only the rows its devices hold, and the iterator state is just the next row number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.sharding import Sharding

if TYPE_CHECKING:
  from MaxText.data.tokenizer import Tokenizer

FIELDS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")


class RowSource(Protocol):
  """Rows of one data stream, addressed by global row number."""

  def rows(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
    """(tokens, segmentation, positions[, loss_mask]), each int32 [len(indices), length]; segment 0 is
    padding; the optional loss_mask (supervised fine-tuning) is 0 for tokens that are never targets."""
    ...

  def state(self, next_row: int) -> dict[str, Any]:
    """JSON-serialisable position of the stream just before row `next_row`."""
    ...

  def next_row(self, state: dict[str, Any]) -> int:
    """Inverse of `state`; raises DataError (a ValueError) when `state` does not belong to this stream."""
    ...


def complete_rows(
  tokens: np.ndarray, segmentation: np.ndarray, positions: np.ndarray, loss_mask: np.ndarray | None = None
) -> dict[str, np.ndarray]:
  """The batch dict of [rows, length] int32 arrays from token rows and their segment ids.

  targets[b, i] = tokens[b, i + 1] when position i + 1 belongs to the same segment; otherwise (the last
  token of a document piece, of the row, or padding) the target is 0 and targets_segmentation is 0.
  `loss_mask` (supervised fine-tuning): [rows, length], nonzero for the tokens worth predicting; a target
  token outside it (a prompt token) keeps its target but gets targets_segmentation 0, hence no loss, while
  inputs_segmentation still lets the completion attend to it.
  """
  tokens, segmentation = tokens.astype(np.int32), segmentation.astype(np.int32)
  same = np.zeros(tokens.shape, dtype=bool)
  same[:, :-1] = (segmentation[:, 1:] == segmentation[:, :-1]) & (segmentation[:, :-1] != 0)
  targets = np.zeros_like(tokens)
  targets[:, :-1] = tokens[:, 1:]
  weighted = same.copy()
  if loss_mask is not None:
    weighted[:, :-1] &= loss_mask[:, 1:] != 0
  return {
    "inputs": tokens,
    "targets": np.where(same, targets, 0),
    "inputs_segmentation": segmentation,
    "targets_segmentation": np.where(weighted, segmentation, 0),
    "inputs_position": positions.astype(np.int32),
  }


def process_rows(sharding: Sharding, global_shape: tuple[int, int]) -> np.ndarray:
  """Sorted global row numbers (within a batch) held by this process's devices.

  This is the local data layout `jax.make_array_from_process_local_data` expects: usually the block
  [p * local, (p + 1) * local); all rows when the batch dimension is not split across processes.
  """
  rows = set()
  for index in sharding.addressable_devices_indices_map(global_shape).values():
    rows.update(range(global_shape[0])[index[0]])
  return np.array(sorted(rows), dtype=np.int64)


class Rows(NamedTuple):
  """This process's first rows of a batch, each [rows, length] (any integer dtype); segment 0 is padding."""

  tokens: np.ndarray
  segmentation: np.ndarray
  positions: np.ndarray
  loss_mask: np.ndarray | None = None  # see complete_rows; None: every non-padding target carries loss
  images: np.ndarray | None = None  # use_multimodal: float32 pixels [rows, images_per_row, S, S, C]


def assemble_batch(
  rows: Rows | None, local_rows: int, sharding: Sharding, global_shape: tuple[int, int]
) -> dict[str, jax.Array]:
  """The global batch (FIELDS -> int32 jax.Array `global_shape` on `sharding`) from this process's rows.

  `rows` holds the first n <= `local_rows` of the rows this process's devices hold (None: n = 0); the other
  local_rows - n become padding rows (segment 0, no loss), so every process contributes its full share even
  when its data has run out.
  """
  length = global_shape[1]
  if rows is None:
    rows = Rows(*(np.zeros((0, length), np.int32) for _ in range(3)))
  missing = local_rows - len(rows.tokens)
  if missing:
    rows = Rows(*(x if x is None else np.concatenate([x, np.zeros((missing, *x.shape[1:]), x.dtype)]) for x in rows))
  local = complete_rows(rows.tokens, rows.segmentation, rows.positions, rows.loss_mask)
  out = {k: jax.make_array_from_process_local_data(sharding, local[k], global_shape) for k in FIELDS}
  if rows.images is not None:  # the batch axis split like the tokens', the rest whole
    spec = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(sharding.spec[0]))
    out["images"] = jax.make_array_from_process_local_data(spec, rows.images, (global_shape[0], *rows.images.shape[1:]))
  return out


class BatchSource(Protocol):
  """An iterator of global batches (FIELDS -> int32 jax.Array [global_batch, length]) that can resume exactly.

  BatchIterator (row-numbered sources) and grain_data.GrainBatches (grain pipelines) are the two kinds.
  """

  def __iter__(self) -> BatchSource: ...

  def __next__(self) -> dict[str, jax.Array]: ...

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position before the next batch (may be a collective across processes)."""
    ...

  def set_state(self, state: dict[str, Any]) -> None:
    """Resume so that the next batches are exactly those that followed `get_state()`."""
    ...


class BatchIterator:
  """The BatchSource of a RowSource: global batches of int32 jax.Arrays [global_batch, length] on `sharding`.

  Endless, or with `num_rows` it stops after rows [0, num_rows): the last batch is completed with padding
  rows (segment 0, hence no loss), so every process runs the same ceil(num_rows / global_batch) steps.
  """

  def __init__(
    self, source: RowSource, sharding: Sharding, global_batch: int, length: int, num_rows: int | None = None
  ):
    self._source = source
    self._sharding = sharding
    self._shape = (global_batch, length)
    self._local_rows = process_rows(sharding, self._shape)
    self._next_row = 0
    self._num_rows = num_rows

  def __iter__(self) -> BatchIterator:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    if self._num_rows is not None and self._next_row >= self._num_rows:
      raise StopIteration
    indices = self._next_row + self._local_rows
    if self._num_rows is not None:  # sorted, so the rows past the end are a suffix: padding
      indices = indices[indices < self._num_rows]
    rows = Rows(*self._source.rows(indices)) if len(indices) else None
    self._next_row += self._shape[0]
    return assemble_batch(rows, len(self._local_rows), self._sharding, self._shape)

  def get_state(self) -> dict[str, Any]:
    """Position before the next batch; `set_state` of it replays exactly the batches that follow."""
    return self._source.state(self._next_row)

  def set_state(self, state: dict[str, Any]) -> None:
    """A state this kind of stream does not write (other keys, values that are not counts) is damaged: ValueError.
    One that does but belongs to another stream (the data changed): the source's DataError."""
    keys = set(self._source.state(0))
    fields = state.values() if isinstance(state, dict) else ()
    if not isinstance(state, dict) or set(state) != keys or not all(_count(v) for v in fields):
      raise ValueError(f"data iterator state {state} is not a position of this stream (keys {sorted(keys)}): damaged")
    self._next_row = self._source.next_row(state)


def _count(value: Any) -> bool:
  return isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 0


class Iterators(NamedTuple):
  """What `MaxText.data.make_iterators` returns."""

  train: BatchSource  # endless (cycles epochs)
  eval_factory: Callable[[], BatchSource] | None  # each call: a fresh iterator at the start of the eval split
  tokenizer: Tokenizer | None  # None for synthetic data
  sample_prompt: str | None = None  # the first words of a held-out document: the closing summary's decode prompt
