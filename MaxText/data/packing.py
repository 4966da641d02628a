"""Tokenized documents -> rows of a fixed length, epoch after epoch, by global row number.

An epoch is the documents in one order (shuffled per epoch by (seed, epoch), or as given). Packed: the
documents are concatenated and cut into rows of `length` tokens; a document crossing a row boundary
continues in the next row as a new segment at position 0; the last row of an epoch is padded. Unpacked:
one document per row, truncated or padded. Every epoch has the same number of rows R, so row n is row
n % R of epoch n // R, and a row is built by numpy indexing alone, without materialising the epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from MaxText.errors import DataError


class DocumentRows:
  """A `batches.RowSource` over documents tokens[offsets[d]:offsets[d + 1]] for d in `doc_ids`.

  `tokens` may be a memory-mapped array of any integer dtype; rows are int32. `seed` None keeps the
  documents in the given order every epoch (evaluation).
  """

  def __init__(
    self, tokens: np.ndarray, offsets: np.ndarray, doc_ids: np.ndarray, length: int, packing: bool, seed: int | None
  ):
    if len(doc_ids) == 0:
      raise ValueError("DocumentRows needs at least one document")
    self._tokens = tokens
    self._starts = offsets[doc_ids].astype(np.int64)
    self._lengths = (offsets[doc_ids + 1] - offsets[doc_ids]).astype(np.int64)
    if np.any(self._lengths <= 0):
      raise ValueError("DocumentRows documents must not be empty")
    self._length = length
    self._packing = packing
    self._seed = seed
    self._cached: tuple[int, Any] = (-1, None)
    total = int(self._lengths.sum())
    self.rows_per_epoch = -(-total // length) if packing else len(doc_ids)

  def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(document order, end offset of each document in the epoch's token stream), kept for the last epoch."""
    if self._cached[0] != epoch:
      n = len(self._lengths)
      order = np.arange(n) if self._seed is None else np.random.default_rng([self._seed, epoch]).permutation(n)
      self._cached = (epoch, (order, np.cumsum(self._lengths[order])))
    return self._cached[1]

  def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shape = (len(indices), self._length)
    tokens, segmentation, positions = (np.zeros(shape, np.int32) for _ in range(3))
    epochs, rows = np.divmod(np.asarray(indices, np.int64), self.rows_per_epoch)
    for epoch in np.unique(epochs):
      sel = epochs == epoch
      build = self._packed if self._packing else self._unpacked
      tokens[sel], segmentation[sel], positions[sel] = build(int(epoch), rows[sel])
    return tokens, segmentation, positions

  def _packed(self, epoch: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order, ends = self._order(epoch)
    row_start = rows[:, None] * self._length
    stream = row_start + np.arange(self._length)  # [rows, length] offsets in the epoch's token stream
    valid = stream < ends[-1]
    piece = np.minimum(np.searchsorted(ends, stream, side="right"), len(order) - 1)
    doc_start = ends[piece] - self._lengths[order[piece]]  # stream offset where each token's document starts
    tokens = self._tokens[self._starts[order[piece]] + np.where(valid, stream - doc_start, 0)]
    segmentation = piece - piece[:, :1] + 1
    positions = stream - np.maximum(doc_start, row_start)
    return (np.where(valid, x, 0) for x in (tokens, segmentation, positions))

  def _unpacked(self, epoch: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    doc = self._order(epoch)[0][rows]
    positions = np.broadcast_to(np.arange(self._length), (len(rows), self._length))
    valid = positions < self._lengths[doc][:, None]
    tokens = self._tokens[self._starts[doc][:, None] + np.where(valid, positions, 0)]
    return (np.where(valid, x, 0) for x in (tokens, valid, positions))

  def state(self, next_row: int) -> dict[str, Any]:
    epoch, row = divmod(next_row, self.rows_per_epoch)
    return {"epoch": epoch, "row": row, "rows_per_epoch": self.rows_per_epoch}

  def next_row(self, state: dict[str, Any]) -> int:
    if state.get("rows_per_epoch") != self.rows_per_epoch:
      raise DataError(  # a user's change of data settings on a resume: one line (launch.USER_ERRORS)
        f"Data state {state} was saved for a stream of {state.get('rows_per_epoch')} rows per epoch, but this one "
        f"has {self.rows_per_epoch}: the corpus, tokenizer, max_target_length or packing changed, so it cannot "
        "resume exactly; restore the original data settings or start a new run_name"
      )
    return int(state["epoch"]) * self.rows_per_epoch + int(state["row"])
