"""Reading data files: glob patterns -> file lists, and files -> documents (the one place every backend and
command-line tool of MaxText/data reads files through).

A .jsonl/.json file holds one document per line (a JSON object whose `column` field is the text), a .parquet
file one per row (its string column `column`); any other file is one document (UTF-8, or a .py file's PEP 263
coding). Files are read through etils `epath`, the path type orbax, grain and tfds use.
"""

from __future__ import annotations

import bisect
import json
import logging
import tokenize
from collections.abc import Iterator, Sequence
from typing import Any

from etils import epath

from MaxText import paths
from MaxText.errors import DataError, StorageError

log = logging.getLogger(__name__)

MULTI_DOCUMENT = (".jsonl", ".json", ".parquet")  # files holding one document per line / row
# Without network or credentials the storage client retries for minutes (and array_record would sit in
# it); a remote pattern that lists nothing in this long fails with one line instead.
REMOTE_CHECK_TIMEOUT_S = 30.0


def matching(pattern: str) -> list[str]:
  """Sorted files matching `pattern`, local or remote (paths.glob; `**` recurses); may be empty. DataError
  naming it when storage does not answer within REMOTE_CHECK_TIMEOUT_S."""
  try:
    return paths.glob(pattern, REMOTE_CHECK_TIMEOUT_S)
  except StorageError as e:
    raise DataError(str(e)) from None


def expand(pattern: str) -> list[str]:
  """`matching(pattern)`, handed to the readers as files (they take no globs on a bucket); DataError naming
  the pattern when no file matches."""
  found = matching(pattern)
  if not found:
    raise DataError(f"{pattern!r} matches no files")
  return found


def read_document(path: str, strict: bool, skipped: list[str] | None = None) -> str:
  """Text of `path`: UTF-8, or a .py file's PEP 263 coding; "" for an undecodable file when not strict (its path
  appended to `skipped` when given, for the caller to count, else logged)."""
  try:
    data = epath.Path(path).read_bytes()
  except OSError as e:
    raise DataError(f"Cannot read document {path!r}: {e}") from None
  try:
    if path.endswith(".py"):
      encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
      return data.decode(encoding)
    return data.decode("utf-8")
  except (UnicodeDecodeError, SyntaxError, LookupError) as e:
    if strict:
      raise DataError(f"Cannot decode document {path!r} as text: {e}") from None
    if skipped is None:
      log.info("Skipping undecodable document %s: %s", path, e)
    else:
      skipped.append(path)
    return ""


def read_texts(path: str, strict: bool, column: str, skipped: list[str] | None = None) -> list[str]:
  """The documents of one file: `column` of each line of a .jsonl/.json file or row of a .parquet file; any
  other file is one document (read_document: `skipped` collects the undecodable ones when not strict). DataError
  naming the file (and line) that cannot be read or lacks `column`."""
  if path.endswith((".jsonl", ".json")):
    return read_jsonl(path, column)
  if path.endswith(".parquet"):
    return read_parquet_column(path, column)
  return [read_document(path, strict, skipped)]


def read_jsonl(path: str, column: str) -> list[str]:
  """The string field `column` of each non-blank line (a JSON object) of `path`."""
  return [text for _, text in jsonl_column(path, column, "set text_column to the field holding the text")]


def jsonl_column(path: str, column: str, hint: str) -> list[tuple[int, str]]:
  """(line number, the string field `column`) of each non-blank line (a JSON object) of `path`; a DataError
  naming the line and the fields it has, ending with `hint` (the key that names the field)."""
  rows = []
  for number, line in enumerate(read_document(path, strict=True).splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{number} is not a JSON object: {e}") from None
    if isinstance(record, dict) and column in record and not isinstance(record[column], str):
      value = "null" if record[column] is None else f"{record[column]!r:.40} (of type {type(record[column]).__name__})"
      raise DataError(f"{path}:{number}: its text field {column!r} is {value}, not a string")
    if not isinstance(record, dict) or not isinstance(record.get(column), str):
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise DataError(f"{path}:{number} has no text field {column!r} (it has {keys}); {hint}")
    rows.append((number, record[column]))
  return rows


def read_parquet_column(path: str, column: str) -> list[str]:
  """The string column `column` of a Parquet file (nulls as ""); DataError naming the file or the column."""
  source = ParquetSource([path], column)
  return [text for group in range(source.num_groups) for text in source.group_texts(group)]


def _parquet_file(path: str) -> Any:
  """pyarrow's ParquetFile of `path`, local or remote (paths.path_or_file)."""
  import pyarrow.parquet as pq

  return pq.ParquetFile(paths.path_or_file(path))


class ParquetSource:
  """Random access to the rows of Parquet files: [i] -> the `column` string of row i ("" for null).

  Reads one row group at a time and keeps the last one, so sequential access reads each group once.
  """

  def __init__(self, paths: Sequence[str], column: str):
    self._paths, self._column, starts = list(paths), column, [0]
    self._groups = []  # (file index, row group) in order
    for i, path in enumerate(self._paths):
      try:
        meta = _parquet_file(path).metadata
      except (OSError, ValueError) as e:  # pyarrow's errors subclass these
        raise DataError(f"Cannot read Parquet file {path!r}: {e}") from None
      if column not in meta.schema.names:
        raise DataError(
          f"Parquet file {path!r} has no column {column!r} (columns: {', '.join(meta.schema.names)}); set text_column"
        )
      for g in range(meta.num_row_groups):
        self._groups.append((i, g))
        starts.append(starts[-1] + meta.row_group(g).num_rows)
    self._starts = starts
    self._cache: tuple[int, list[str]] = (-1, [])

  @property
  def num_groups(self) -> int:
    return len(self._groups)

  def group_texts(self, group: int) -> list[str]:
    """The texts of row group `group` (counted over all files, in order)."""
    file, g = self._groups[group]
    try:
      table = _parquet_file(self._paths[file]).read_row_group(g, columns=[self._column])
    except (OSError, ValueError) as e:
      raise DataError(f"Cannot read row group {g} of Parquet file {self._paths[file]!r}: {e}") from None
    return [t or "" for t in table.column(0).to_pylist()]

  def __len__(self) -> int:
    return self._starts[-1]

  def __getitem__(self, index: int) -> str:
    group = bisect.bisect_right(self._starts, index) - 1
    if self._cache[0] != group:
      self._cache = (group, self.group_texts(group))
    return self._cache[1][index - self._starts[group]]

  def __getstate__(self):  # workers re-read their row groups
    return {**self.__dict__, "_cache": (-1, [])}


def cli_texts(pattern: str, column: str) -> tuple[list[str], Iterator[str]]:
  """For command-line tools: the files matching `pattern` and a lazy stream of their documents; exits with a
  message naming the pattern when no file matches (local or remote)."""
  found = matching(pattern)
  if not found:
    raise SystemExit(f"--files {pattern!r} matches no files")
  return found, (t for p in found for t in read_texts(p, True, column))
