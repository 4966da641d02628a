"""Local text corpora (.txt, .jsonl, .parquet; as dataset_type=text reads them) -> ArrayRecord files for grain.

python3 -m MaxText.data.convert_to_arrayrecord --files 'corpus/**/*.jsonl' --output_dir data/ --num_shards 8

Each document becomes one record: the JSON object {"text": ...}. Documents are spread round-robin over
`num_shards` files <output_dir>/<prefix>-0000i-of-0000n.array_record (group_size 1: fast random access).
Train with dataset_type=grain grain_train_files='data/<prefix>-*.array_record'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence

from MaxText import launch, paths
from MaxText.data.files import cli_texts
from MaxText.errors import DataError


def write_arrayrecord(texts: Iterable[str], output_dir: str, prefix: str = "data", num_shards: int = 1) -> list[str]:
  """Write each non-blank text as a {"text": ...} record; returns the paths of the shards written."""
  from array_record.python.array_record_module import ArrayRecordWriter

  os.makedirs(output_dir, exist_ok=True)
  shards = [os.path.join(output_dir, f"{prefix}-{i:05d}-of-{num_shards:05d}.array_record") for i in range(num_shards)]
  writers = [ArrayRecordWriter(p, "group_size:1") for p in shards]
  count = 0
  try:
    for text in texts:
      if text.strip():
        writers[count % num_shards].write(json.dumps({"text": text}).encode())
        count += 1
  finally:
    for w in writers:
      w.close()
  if count == 0:
    raise DataError("No documents to convert: every input text is empty")
  return shards


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  parser = argparse.ArgumentParser(
    prog="python3 -m MaxText.data.convert_to_arrayrecord",
    epilog="More: docs/data.md in the repository.",
    description=__doc__.splitlines()[0],
  )
  parser.add_argument("--files", required=True, help="glob of input files ('**' recurses), local or gs://")
  parser.add_argument("--output_dir", required=True, help="directory for the .array_record files, local or gs://")
  parser.add_argument("--prefix", default="data", help="file name prefix")
  parser.add_argument("--num_shards", type=int, default=1, help="number of output files")
  parser.add_argument("--text_column", default="text", help=".jsonl/.parquet field holding the text")
  args = parser.parse_args(argv[1:])
  with launch.user_errors(), paths.local_output_dir(args.output_dir, "--output_dir") as local:  # local or gs://
    _, texts = cli_texts(args.files, args.text_column)
    written = write_arrayrecord(texts, local, args.prefix, args.num_shards)
  print(f"Wrote {len(written)} ArrayRecord files: {paths.join(args.output_dir, args.prefix)}-*.array_record")


if __name__ == "__main__":
  main(sys.argv)
