"""Offline distillation's stored teacher (objective=distill with distill_topk_path; docs/distillation.md).

`python3 -m MaxText.distill_topk` writes, for each row the teacher saw, its tokens (the batch fields), the teacher's
top-k logits per position (values float32 and vocabulary ids int32, [T, k]), the log-sum-exp of all its logits
/ distill_temperature (float32 [T]: the top-k's exact probabilities, and the mass left to the other tokens) and its
log-probability of the target (float32 [T]), one ArrayRecord record per row, in shards
<dir>/<split>-NNNNN.arrayrecord, and <dir>/topk.json (k, vocab_size, max_target_length, the temperature, the
tokenizer's sha256, rows per split). Training reads the rows back as
batches (TopkBatches): row n of the train split is record n mod rows (epochs repeat in order), so the batches are
deterministic and the iterator state is the next row number, as for every row-numbered source (data/batches.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from MaxText import paths, sharding
from MaxText.config import Config
from MaxText.data.batches import FIELDS, process_rows
from MaxText.data.tokenizer import MODEL_FILE
from MaxText.errors import ConfigError, DataError

META_FILE = "topk.json"
ROWS_PER_SHARD = 1024
TOPK_FIELDS = ("topk_values", "topk_ids", "teacher_lse", "teacher_logp")  # the batch fields besides data.FIELDS


class Meta(NamedTuple):
  k: int
  vocab_size: int
  max_target_length: int
  temperature: float  # distill_temperature the log-sum-exp was taken at (training must use the same)
  tokenizer: str  # sha256 of the tokenizer file the rows were tokenized with ("" for synthetic data)
  rows: dict[str, int]  # split -> rows written


def tokenizer_digest(config: Config) -> str:
  """sha256 of the run's tokenizer file (tokenizer_path, or the one trained into tokenizer_dir); "" for none."""
  path = config.tokenizer_path or paths.join(config.tokenizer_dir, MODEL_FILE)
  if config.dataset_type == "synthetic" or not paths.isfile(path):
    return ""
  return hashlib.sha256(paths.Path(path).read_bytes()).hexdigest()


def shard_path(directory: str, split: str, shard: int) -> str:
  return os.path.join(directory, f"{split}-{shard:05d}.arrayrecord")


def encode(row: dict[str, np.ndarray]) -> bytes:
  """One row's fields (FIELDS int32 [T], topk_values float32 [T, k], topk_ids int32 [T, k], teacher_lse and
  teacher_logp float32 [T])."""
  parts = [row[k].astype(np.int32) for k in FIELDS]
  parts += [row["topk_values"].astype(np.float32), row["topk_ids"].astype(np.int32)]
  parts += [row["teacher_lse"].astype(np.float32), row["teacher_logp"].astype(np.float32)]
  return b"".join(p.tobytes() for p in parts)


def decode(data: bytes, length: int, k: int) -> dict[str, np.ndarray]:
  sizes = [(k_, np.int32, (length,)) for k_ in FIELDS]
  sizes += [("topk_values", np.float32, (length, k)), ("topk_ids", np.int32, (length, k))]
  sizes += [("teacher_lse", np.float32, (length,)), ("teacher_logp", np.float32, (length,))]
  row, offset = {}, 0
  for name, dtype, shape in sizes:
    count = int(np.prod(shape))
    row[name] = np.frombuffer(data, dtype, count, offset).reshape(shape)
    offset += count * 4
  return row


class Writer:
  """Rows of one split into shards of ROWS_PER_SHARD records."""

  def __init__(self, directory: str, split: str):
    self.directory, self.split, self.rows, self._writer = directory, split, 0, None

  def write(self, row: dict[str, np.ndarray]) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter  # noqa: PLC0415 (grain's dependency)

    if self.rows % ROWS_PER_SHARD == 0:
      self.close()
      path = shard_path(self.directory, self.split, self.rows // ROWS_PER_SHARD)
      self._writer = ArrayRecordWriter(path, "group_size:1")
    self._writer.write(encode(row))
    self.rows += 1

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def write_meta(directory: str, meta: Meta) -> None:
  with open(os.path.join(directory, META_FILE), "w") as f:
    json.dump(meta._asdict(), f, indent=1)


def read_meta(config: Config) -> Meta:
  """distill_topk_path's topk.json, checked against the run: one-line ConfigError for shards of another length,
  vocabulary or tokenizer, or with k above the vocabulary."""
  directory = config.distill_topk_path
  path = os.path.join(directory, META_FILE)
  if not os.path.isfile(path):
    raise ConfigError(
      f"distill_topk_path={directory!r} has no {META_FILE}: write it with python3 -m MaxText.distill_topk"
    )
  with open(path) as f:
    meta = Meta(**json.load(f))
  where = f"the top-k shards in {directory!r}"
  if meta.max_target_length != config.max_target_length:
    raise ConfigError(
      f"{where} hold rows of {meta.max_target_length} tokens; set max_target_length={meta.max_target_length}"
    )
  if meta.vocab_size != config.vocab_size or meta.k > config.vocab_size:
    raise ConfigError(
      f"{where} come from a vocabulary of {meta.vocab_size} (k={meta.k}); the student's vocab_size is "
      f"{config.vocab_size}: generate them with the student's tokenizer and vocab_size"
    )
  if meta.temperature != config.distill_temperature:
    raise ConfigError(f"{where} were written at distill_temperature={meta.temperature}; train with that temperature")
  digest = tokenizer_digest(config)
  if digest and meta.tokenizer and digest != meta.tokenizer:
    raise ConfigError(f"{where} were tokenized with another tokenizer than tokenizer_path={config.tokenizer_path!r}")
  if not meta.rows.get("train"):
    raise ConfigError(f"{where} hold no train rows")
  return meta


class TopkBatches:
  """Global batches (FIELDS and TOPK_FIELDS as jax.Arrays sharded over the data axes) of one split's rows; endless
  (train: epochs repeat in order) or one pass (eval, the last batch padded with segment-0 rows)."""

  def __init__(self, config: Config, mesh: Any, meta: Meta, split: str, global_batch: int, endless: bool):
    from array_record.python.array_record_module import ArrayRecordReader  # noqa: PLC0415

    self.meta, self.endless, self.num_rows = meta, endless, meta.rows[split]
    count = -(-self.num_rows // ROWS_PER_SHARD)
    self._readers = [ArrayRecordReader(shard_path(config.distill_topk_path, split, i)) for i in range(count)]
    self._shape = (global_batch, meta.max_target_length)
    self._sharding = {r: sharding.input_sharding(config, mesh, rank=r) for r in (2, 3)}
    self._local = process_rows(self._sharding[2], self._shape)
    self._next_row = 0

  def __iter__(self) -> TopkBatches:
    return self

  def _row(self, n: int) -> dict[str, np.ndarray]:
    n = n % self.num_rows
    data = self._readers[n // ROWS_PER_SHARD].read([n % ROWS_PER_SHARD])[0]
    return decode(data, self.meta.max_target_length, self.meta.k)

  def __next__(self) -> dict[str, jax.Array]:
    if not self.endless and self._next_row >= self.num_rows:
      raise StopIteration
    indices = self._next_row + self._local
    rows = [self._row(n) if self.endless or n < self.num_rows else None for n in indices]
    blank = {k: np.zeros_like(v) for k, v in self._row(0).items()}
    self._next_row += self._shape[0]
    out = {}
    for name, value in blank.items():
      local = np.stack([value if r is None else r[name] for r in rows])
      global_shape = (self._shape[0], *local.shape[1:])
      out[name] = jax.make_array_from_process_local_data(self._sharding[local.ndim], local, global_shape)
    return out

  def get_state(self) -> dict[str, Any]:
    return {"topk_row": self._next_row}

  def set_state(self, state: dict[str, Any]) -> None:
    if set(state) != {"topk_row"}:
      raise DataError(f"the top-k data's state must be {{'topk_row': n}}, got {state}")
    self._next_row = int(state["topk_row"])
