"""dataset_type=tfds: a TFDS dataset (`dataset_name` under the data_dir `dataset_path`) -> the grain pipeline.

`tfds.data_source` gives random access to datasets prepared in the array_record file format, without
TensorFlow; shuffling, per-process shards and resume are then the grain pipeline's (grain_data.py): exact.
Datasets stored as TFRecord (such as the C4 copy in MaxText's bucket) must be converted once with
`tfds convert_format --dataset_version_dir=<dir>/c4/en/3.0.1 --out_file_format=array_record --out_dir=...`
(reading TFRecord needs `pip install tensorflow`); download_dataset.sh does it when asked.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from MaxText.config import Config
from MaxText.data import tokenizer as tokenizers
from MaxText.data.batches import Iterators
from MaxText.data.grain_data import Component, check_source, make_pipeline
from MaxText.errors import DataError


def data_source(config: Config, split: str) -> Any:
  """Random access to `split` of dataset_name; DataError naming the dataset, data_dir and split on failure."""
  import tensorflow_datasets as tfds

  where = f"TFDS dataset {config.dataset_name!r} split {split!r} in dataset_path={config.dataset_path!r}"
  try:
    source = tfds.data_source(config.dataset_name, split=split, data_dir=config.dataset_path or None, download=False)
  except Exception as e:  # tfds raises DatasetNotFoundError, AssertionError, NotImplementedError (tfrecord) ...
    hint = " (prepare it with file_format=array_record, or convert it: see download_dataset.sh)"
    raise DataError(f"Cannot open the {where}: {type(e).__name__}: {e}{hint}") from None
  return check_source(source, where, config.text_column)


def make_iterators(config: Config, mesh: Mesh) -> Iterators:
  """train_split and eval_split (empty: no eval) of dataset_name; see MaxText.data."""
  tok = tokenizers.load_for_config(config)
  train = data_source(config, config.train_split)
  eval_source = data_source(config, config.eval_split) if config.eval_split else None
  return make_pipeline(config, mesh, [Component(train, 1.0)], eval_source, tok)
