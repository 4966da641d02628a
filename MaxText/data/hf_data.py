"""dataset_type=hf: Hugging Face `datasets` -> the grain pipeline (grain_data.py) -> packed global batches.

`datasets.load_dataset(hf_path, hf_name, data_dir=hf_data_dir, data_files=hf_train_files, split=train_split)`
gives a memory-mapped Arrow table with random access, so shuffling, per-process shards and resume are the
grain pipeline's: exact. Local files work offline: hf_path=parquet | json | arrow (or csv, text) with
hf_train_files (a glob), or hf_path=a directory that `save_to_disk` wrote (read by datasets.load_from_disk).
Hub names download into the Hugging Face cache when a network exists; streaming (IterableDataset) is not
used, so a Hub dataset must fit the local disk.
"""

from __future__ import annotations

import os
from typing import Any

from jax.sharding import Mesh

from MaxText import paths
from MaxText.config import Config
from MaxText.data import tokenizer as tokenizers
from MaxText.data.batches import Iterators
from MaxText.data.files import expand
from MaxText.data.grain_data import Component, check_source, make_pipeline
from MaxText.errors import DataError


def load_split(config: Config, split: str, files: str) -> Any:
  """One split as a random-access `datasets.Dataset`; DataError naming hf_path / the files on failure."""
  import datasets

  data_files = None
  if files:
    data_files = {split: [p for pattern in files.split(",") for p in expand(pattern.strip())]}
  where = f"hf_path={config.hf_path!r}" + (f" files {files!r}" if files else "") + f" split {split!r}"
  if not files and _saved_to_disk(config.hf_path):
    return _load_from_disk(config, split, where)
  try:
    return datasets.load_dataset(
      config.hf_path,
      name=config.hf_name or None,
      data_dir=config.hf_data_dir or None,
      data_files=data_files,
      split=split,
    )
  except Exception as e:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ValueError...)
    raise DataError(f"Cannot load the Hugging Face dataset {where}: {type(e).__name__}: {e}") from None


def _saved_to_disk(path: str) -> bool:
  """A local directory that `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote (load_dataset refuses it)."""
  directory = os.path.expanduser(path)
  if not paths.isdir(directory):  # a builder name (parquet, json) or a Hub name
    return False
  return any(paths.isfile(paths.join(directory, f)) for f in ("state.json", "dataset_dict.json"))


def _load_from_disk(config: Config, split: str, where: str) -> Any:
  """A saved DatasetDict's `split`; a saved Dataset (no splits) serves train_split only."""
  import datasets

  try:
    saved = datasets.load_from_disk(os.path.expanduser(config.hf_path))
  except Exception as e:  # a damaged directory: FileNotFoundError, ArrowInvalid, JSONDecodeError...
    raise DataError(f"Cannot load the saved Hugging Face dataset {where}: {type(e).__name__}: {e}") from None
  if isinstance(saved, datasets.DatasetDict):
    if split not in saved:
      raise DataError(f"{where}: the saved DatasetDict has splits {sorted(saved)}, not {split!r}")
    return saved[split]
  if split != config.train_split:
    raise DataError(f"{where}: a saved Dataset has no splits; save a DatasetDict with a {split!r} split")
  return saved


def make_iterators(config: Config, mesh: Mesh) -> Iterators:
  """train_split (of hf_train_files, if set) and hf_eval_split or hf_eval_files; see MaxText.data."""
  tok = tokenizers.load_for_config(config)
  train = load_split(config, config.train_split, config.hf_train_files)
  train = check_source(train, f"hf_path={config.hf_path!r} split {config.train_split!r}", config.text_column)
  eval_source = None
  if config.hf_eval_split or config.hf_eval_files:
    split = config.hf_eval_split or "eval"
    eval_source = load_split(config, split, config.hf_eval_files if not config.hf_eval_split else "")
    eval_source = check_source(eval_source, f"hf_path={config.hf_path!r} split {split!r}", config.text_column)
  return make_pipeline(config, mesh, [Component(train, 1.0)], eval_source, tok)
