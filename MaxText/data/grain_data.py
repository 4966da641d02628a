"""dataset_type=grain: ArrayRecord or Parquet files -> grain pipeline -> packed global batches, resumable exactly.

Pipeline (also used by the tfds and hf backends, which only supply other random-access sources):
  sources (one per mixture component) --shuffle(data_shuffle_seed, reshuffled per epoch)--> repeat
  --mix(weights)--> [shard::num_shards] --tokenize--> pack (or pad/truncate) --batch(local rows)--> workers
Each process reads only its shards: the global record order is sliced into shards (at a fresh start one per
block of batch rows a process holds), so no two data shards share a record in an epoch, and shards holding
the same rows (data replicated across processes) produce the same data. The iterator state is grain's,
gathered from every shard, so that the checkpoint (written by process 0) restores every process exactly,
also on another number of processes (the shard count is kept: GrainBatches).

ArrayRecord records are UTF-8 text, or a JSON object whose `text_column` field holds the text (see
MaxText/data/convert_to_arrayrecord.py). Parquet rows give their `text_column`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, Sharding

from MaxText import paths, sharding
from MaxText.config import Config
from MaxText.data import tokenizer as tokenizers
from MaxText.data.batches import Iterators, Rows, assemble_batch, process_rows
from MaxText.data.files import ParquetSource, expand
from MaxText.errors import DataError


class Component(NamedTuple):
  source: Any  # random access: len() and [i] -> a record (bytes, str or dict)
  weight: float


def parse_mixture(spec: str) -> list[tuple[str, float]]:
  """ "glob" or "glob1,0.7;glob2,0.3" -> [(glob, weight)], weights normalised to sum to 1."""
  parts = []
  for item in filter(None, (s.strip() for s in spec.split(";"))):
    pattern, _, weight = item.rpartition(",")
    try:
      parts.append((pattern, float(weight)) if pattern else (item, 1.0))
    except ValueError:
      parts.append((item, 1.0))  # a comma inside the glob itself
  if not parts or any(w <= 0 for _, w in parts):
    raise DataError(f"Cannot parse the file mixture {spec!r}: expected 'glob' or 'glob1,0.7;glob2,0.3' (weights > 0)")
  total = sum(w for _, w in parts)
  return [(p, w / total) for p, w in parts]


def record_text(record: Any, column: str) -> str:
  """The text of one record: a dict's `column`, a JSON object's `column`, or the record itself as text."""
  if isinstance(record, (bytes, np.bytes_)):
    record = bytes(record).decode("utf-8")
  if isinstance(record, str) and record.startswith("{"):
    try:
      record = json.loads(record)
    except json.JSONDecodeError:
      return record
  if isinstance(record, dict):
    if column not in record:
      raise DataError(f"Record has no text field {column!r} (fields: {', '.join(map(str, record))}); set text_column")
    return record_text(record[column], column) if not isinstance(record[column], str) else record[column]
  if not isinstance(record, str):
    raise DataError(f"Record of type {type(record).__name__} holds no text")
  return record


def open_source(files: Sequence[str], file_type: str, column: str) -> Any:
  """A random-access source over `files`; DataError naming an unreadable file, an empty source, or no text."""
  if file_type == "parquet":
    source = ParquetSource(files, column)
  else:
    from grain.sources import ArrayRecordDataSource

    for path in files:
      if not paths.may_read(path):
        raise DataError(f"Cannot read ArrayRecord file {path!r}")
    try:
      source = ArrayRecordDataSource(list(files))
    except Exception as e:  # array_record raises RuntimeError/ValueError/OSError by version
      raise DataError(f"Cannot read ArrayRecord files {', '.join(files)}: {e}") from None
  return check_source(source, ", ".join(files), column)


def check_source(source: Any, where: str, column: str) -> Any:
  """`source` when it is non-empty and its first record has text; else DataError naming `where`."""
  if len(source) == 0:
    raise DataError(f"The dataset {where} is empty")
  try:
    record_text(source[0], column)
  except ValueError as e:
    raise DataError(f"{where}: {e}") from None
  return source


class Tokenize:
  """Record -> {"inputs": int32 tokens (+ BOS/EOS)}, or None for an empty text. Loads its tokenizer lazily, so
  grain worker processes unpickle a path, not a tokenizer."""

  def __init__(self, config: Config):
    self._path, self._type, self._column = config.tokenizer_path, config.tokenizer_type, config.text_column
    self._bos, self._eos = config.add_bos, config.add_eos
    self._tok = None

  def __call__(self, record: Any) -> dict[str, np.ndarray] | None:
    if self._tok is None:
      self._tok = tokenizers.load_tokenizer(self._path, self._type)
    text = record_text(record, self._column)
    ids = self._tok.encode(text) if text.strip() else []
    if not ids:
      return None
    return {"inputs": np.array([self._tok.bos_id] * self._bos + ids + [self._tok.eos_id] * self._eos, np.int32)}

  def __getstate__(self):
    return {**self.__dict__, "_tok": None}


def pad_or_truncate(length: int):
  """One document per row: {"inputs"} -> inputs, inputs_segment_ids (1, then 0 padding), inputs_positions."""

  def fn(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    ids = example["inputs"][:length]
    out = {k: np.zeros(length, np.int32) for k in ("inputs", "inputs_segment_ids", "inputs_positions")}
    out["inputs"][: len(ids)], out["inputs_segment_ids"][: len(ids)] = ids, 1
    out["inputs_positions"][: len(ids)] = np.arange(len(ids))
    return out

  return fn


class DataShard(NamedTuple):
  index: int  # which shard of the records
  count: int  # how many shards the records are split into
  rows: int  # batch rows the shard gives per batch


def data_shard(spec: Sharding, global_batch: int, length: int) -> DataShard:
  """This process's block of batch rows -> its shard; ValueError when its rows are not one aligned block."""
  rows = process_rows(spec, (global_batch, length))
  start, local = int(rows[0]), len(rows)
  if not np.array_equal(rows, np.arange(start, start + local)) or start % local:
    raise ValueError(f"Process {jax.process_index()} holds batch rows {list(rows)}: not one aligned block")
  return DataShard(start // local, global_batch // local, local)


def build_dataset(config: Config, components: Sequence[Component], shard: DataShard, train: bool) -> Any:
  """The grain IterDataset of one shard's local batches: dicts of int32 [shard.rows, max_target_length].

  train: shuffled (reshuffled every epoch) and endless. Eval: in order; endless when eval_steps > 0, else one
  epoch whose last batch may be short.
  """
  import grain
  from grain import experimental

  datasets = []
  for c in components:
    ds = grain.MapDataset.source(c.source)
    ds = ds.shuffle(seed=config.data_shuffle_seed).repeat(None) if train else ds
    datasets.append(ds.repeat(None) if not train and config.eval_steps != -1 else ds)
  ds = datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, [c.weight for c in components])
  ds = ds[shard.index :: shard.count].map(Tokenize(config)).filter(lambda x: x is not None)
  length = config.max_target_length
  if config.packing:
    ds = experimental.ConcatThenSplitIterDataset(ds.to_iter_dataset(), length_struct={"inputs": length})
  else:
    ds = ds.map(pad_or_truncate(length)).to_iter_dataset()
  ds = ds.batch(shard.rows, drop_remainder=False)
  if config.grain_worker_count > 0:
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; our entry points do not parse any
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.grain_worker_count))
  return ds


def _allgather_strings(text: str) -> list[str]:
  """`text` of every process, in process order (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return [text]
  from jax.experimental import multihost_utils

  data = np.frombuffer(text.encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([len(data)], np.int32)).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: len(data)] = data
  gathered = multihost_utils.process_allgather(padded).reshape(len(sizes), -1)
  return [bytes(row[:n]).decode() for row, n in zip(gathered, sizes)]


class GrainBatches:
  """A batches.BatchSource: global batches (int32 jax.Arrays [global_batch, length] on `spec`) from grain
  datasets of local batches. `finite`: stop once every process has run out, padding the processes that ran out
  first, so that all run the same number of steps; padding rows have segment 0 and carry no loss.

  The records are split into a number of shards (at a fresh start one per block of batch rows a process holds,
  data_shard); shard i gives rows [i * rows, (i + 1) * rows) of every global batch, rows = global_batch /
  shards. A process runs the shards that hold its rows and keeps its own, so the global batches do not depend
  on how many processes build them: a resume on another process count keeps the checkpoint's shard count (in
  its state) and continues exactly (docs/checkpoints.md, "Resuming on a different number of chips")."""

  def __init__(self, build: Callable[[DataShard], Any], spec: Sharding, global_batch: int, length: int, finite: bool):
    self._build, self._spec, self._shape, self._finite = build, spec, (global_batch, length), finite
    natural = data_shard(spec, global_batch, length)  # checks that this process holds one aligned block
    self._block = (natural.index * natural.rows, natural.rows)  # (first row, rows) this process holds
    self._use(natural.count)

  def _use(self, count: int) -> None:
    """Read `count` shards: build the iterators of those that hold this process's rows."""
    rows = self._shape[0] // count
    start, local = self._block
    first, last = start // rows, (start + local - 1) // rows
    self._count, self._offset = count, start - first * rows
    self._shards = [DataShard(i, count, rows) for i in range(first, last + 1)]
    self._its = [iter(self._build(shard)) for shard in self._shards]

  def __iter__(self) -> GrainBatches:
    return self

  def _next_of(self, it: Any) -> dict[str, np.ndarray] | None:
    try:
      return next(it)
    except StopIteration:
      if not self._finite:
        raise RuntimeError("The grain training dataset ended; it should repeat forever") from None
      return None

  def _local(self) -> dict[str, np.ndarray] | None:
    """This process's rows of the next batch (None when its data has run out)."""
    parts = [part for part in map(self._next_of, self._its) if part is not None]
    if not parts:
      return None
    rows = slice(self._offset, self._offset + self._block[1])
    return {k: np.concatenate([part[k] for part in parts])[rows] for k in parts[0]}

  def __next__(self) -> dict[str, jax.Array]:
    local = self._local()
    if self._finite and not any(json.loads(s) for s in _allgather_strings(json.dumps(local is not None))):
      raise StopIteration
    rows = None
    if local is not None:  # a short last batch is completed with padding rows by assemble_batch
      positions = local.get("inputs_positions", np.zeros_like(local["inputs"]))
      rows = Rows(local["inputs"], local["inputs_segment_ids"], positions)
    return assemble_batch(rows, self._block[1], self._spec, self._shape)

  def get_state(self) -> dict[str, Any]:
    """Every shard's grain state (a collective in multi-process runs: all processes call it together)."""
    mine = {str(shard.index): it.get_state() for shard, it in zip(self._shards, self._its)}
    states: dict[str, Any] = {}
    for text in _allgather_strings(json.dumps(mine)):
      states.update(json.loads(text))
    return {"num_shards": self._count, "shards": [states[str(i)] for i in range(self._count)]}

  def set_state(self, state: dict[str, Any]) -> None:
    count, shards = (state.get("num_shards"), state.get("shards")) if isinstance(state, dict) else (None, None)
    if type(count) is not int or count < 1 or not isinstance(shards, list) or len(shards) != count:
      raise ValueError(f"grain iterator state {str(state)[:200]} is not {{num_shards: n, shards: [n states]}}: damaged")
    if self._shape[0] % count:
      raise DataError(
        f"Data state for {count} shards ({len(shards)} shard states) cannot resume a global batch of "
        f"{self._shape[0]} rows exactly: keep the global batch of the run (elastic_resume=true keeps it)"
      )
    if count != self._count:
      self._use(count)
    for shard, it in zip(self._shards, self._its):
      it.set_state(shards[shard.index])


def make_pipeline(
  config: Config, mesh: Mesh, train: Sequence[Component], eval_source: Any | None, tok: tokenizers.Tokenizer
) -> Iterators:
  """Iterators over random-access sources through the grain pipeline (shared by grain, tfds and hf)."""
  spec, length = sharding.input_sharding(config, mesh), config.max_target_length
  train_batch = sharding.global_batch_size(config, mesh)
  train_it = GrainBatches(lambda shard: build_dataset(config, train, shard, True), spec, train_batch, length, False)
  if eval_source is None:
    return Iterators(train_it, None, tok)
  eval_batch = sharding.global_batch_size(config, mesh, config.eval_per_device_batch_size or None)
  eval_config = config.replace(grain_worker_count=0)  # short, restarted every evaluation: no worker start-up

  def eval_factory() -> GrainBatches:
    build = lambda shard: build_dataset(eval_config, [Component(eval_source, 1.0)], shard, False)  # noqa: E731
    return GrainBatches(build, spec, eval_batch, length, config.eval_steps == -1)

  return Iterators(train_it, eval_factory, tok)


def make_iterators(config: Config, mesh: Mesh) -> Iterators:
  """grain_train_files (a mixture of globs) and grain_eval_files of grain_file_type; see MaxText.data."""
  tok = tokenizers.load_for_config(config)
  column, file_type = config.text_column, config.grain_file_type
  train = [Component(open_source(expand(p), file_type, column), w) for p, w in parse_mixture(config.grain_train_files)]
  eval_source = open_source(expand(config.grain_eval_files), file_type, column) if config.grain_eval_files else None
  return make_pipeline(config, mesh, train, eval_source, tok)
