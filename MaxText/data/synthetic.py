"""dataset_type=synthetic: deterministic random tokens, one document per row, no files, no tokenizer.

Row n of a stream is drawn from numpy seeded by (data_shuffle_seed, stream, n), so the global batch is the
same whatever the number of processes and each process draws only its own rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from MaxText import sharding
from MaxText.config import Config
from MaxText.data.batches import BatchIterator, Iterators
from MaxText.errors import DataError

TRAIN_STREAM, EVAL_STREAM = 0, 1


class SyntheticRows:
  """A `batches.RowSource` of uniform tokens in [1, vocab_size); state {"step": batches consumed}."""

  def __init__(self, seed: int, stream: int, vocab_size: int, length: int, global_batch: int):
    if vocab_size < 2:
      raise DataError(f"Synthetic data draws tokens from [1, vocab_size); vocab_size={vocab_size} leaves none")
    self._seed, self._stream = seed, stream
    self._vocab_size, self._length, self._global_batch = vocab_size, length, global_batch

  def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = np.stack(
      [
        np.random.default_rng([self._seed, self._stream, int(n)]).integers(1, self._vocab_size, self._length)
        for n in indices
      ]
    ).reshape(len(indices), self._length)
    positions = np.broadcast_to(np.arange(self._length), tokens.shape)
    return tokens.astype(np.int32), np.ones_like(tokens, np.int32), positions.astype(np.int32)

  def state(self, next_row: int) -> dict[str, Any]:
    return {"step": next_row // self._global_batch}

  def next_row(self, state: dict[str, Any]) -> int:
    if set(state) != {"step"}:
      raise DataError(f"Synthetic data state must be {{'step': n}}, got {state}")
    return int(state["step"]) * self._global_batch


def make_iterators(config: Config, mesh: Mesh) -> Iterators:
  """Train and eval iterators on different seed streams; no tokenizer. See MaxText.data.make_iterators."""
  spec = sharding.input_sharding(config, mesh)
  length = config.max_target_length

  def iterator(stream: int, batch: int) -> BatchIterator:
    rows = SyntheticRows(config.data_shuffle_seed, stream, config.vocab_size, length, batch)
    return BatchIterator(rows, spec, batch, length)

  train_batch = sharding.global_batch_size(config, mesh)
  eval_batch = sharding.global_batch_size(config, mesh, config.eval_per_device_batch_size or None)
  return Iterators(iterator(TRAIN_STREAM, train_batch), lambda: iterator(EVAL_STREAM, eval_batch), None)
