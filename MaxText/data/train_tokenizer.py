"""Train SentencePiece on local or gs:// files (.txt, .jsonl, .parquet, ...) as dataset_type=text reads them.

python3 -m MaxText.data.train_tokenizer --files 'data/**/*.jsonl' --vocab_size 32000 --output_dir tok/

Writes <output_dir>/tokenizer.model (use it as tokenizer_path) and tokenizer.vocab; see
tokenizer.train_sentencepiece for the kind of model trained.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from MaxText import launch, paths
from MaxText.data.files import cli_texts
from MaxText.data.tokenizer import load_tokenizer, train_sentencepiece


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  parser = argparse.ArgumentParser(
    prog="python3 -m MaxText.data.train_tokenizer",
    epilog="More: docs/data.md in the repository.",
    description=__doc__.splitlines()[0],
  )
  parser.add_argument("--files", required=True, help="glob of training files ('**' recurses), local or gs://")
  parser.add_argument("--vocab_size", type=int, required=True, help="at most this many pieces")
  parser.add_argument(
    "--output_dir", required=True, help="writes tokenizer.model and tokenizer.vocab here (local or gs://)"
  )
  parser.add_argument("--text_column", default="text", help=".jsonl/.parquet field holding the text")
  parser.add_argument("--seed", type=int, default=0, help="seed of the sentence sampling")
  args = parser.parse_args(argv[1:])
  with launch.user_errors(), paths.local_output_dir(args.output_dir, "--output_dir") as local:  # local or gs://
    files, texts = cli_texts(args.files, args.text_column)
    path = train_sentencepiece(texts, args.vocab_size, local, args.seed)
    pieces = load_tokenizer(path).vocab_size
  print(f"{paths.join(args.output_dir, os.path.basename(path))}: {pieces} pieces from {len(files)} files")


if __name__ == "__main__":
  main(sys.argv)
