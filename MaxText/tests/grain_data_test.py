"""dataset_type=grain (MaxText/data/grain_data.py): ArrayRecord/Parquet, mixtures, packing, exact resume, eval."""

import json
import os

import numpy as np
import pytest

from MaxText.data import make_iterators
from MaxText.data.convert_to_arrayrecord import main as convert_main
from MaxText.data.convert_to_arrayrecord import write_arrayrecord
from MaxText.data.grain_data import parse_mixture
from MaxText.tests.conftest import (
  DOCS,
  as_numpy,
  assert_same_batches,
  check_batch,
  data_config,
  decoded_segments,
  mesh_of,
  take_batches,
)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  """DOCS as two ArrayRecord shards, and the first 7 of them as an eval file."""
  root = tmp_path_factory.mktemp("records")
  train = write_arrayrecord(DOCS, str(root), "train", num_shards=2)
  write_arrayrecord(DOCS[:7], str(root), "eval")
  return root, train


def _grain_config(tmp_path, corpus, records, *overrides):
  root, _ = records
  return data_config(
    tmp_path,
    "dataset_type=grain",
    f"grain_train_files={root}/train-*",
    f"tokenizer_path={corpus[1]}",
    "grain_worker_count=0",
    *overrides,
  )


def test_grain_batches_pack_documents(tmp_path, corpus, records):
  cfg = _grain_config(tmp_path, corpus, records)
  mesh = mesh_of(cfg, 8)
  its = make_iterators(cfg, mesh)
  batches = [check_batch(next(its.train), cfg, mesh, 8) for _ in range(3)]
  pieces = [p for b in batches for p in decoded_segments(b, its.tokenizer)]
  assert all(any(piece in doc for doc in DOCS) for piece, *_ in pieces)
  assert max(np.max(b["inputs_segmentation"]) for b in batches) >= 3  # several documents share a row
  assert not any(has_target for *_, has_target in pieces)  # no target across documents or rows


def test_grain_epochs_cover_each_document_once_and_reshuffle(tmp_path, corpus, records):
  cfg = _grain_config(tmp_path, corpus, records, "packing=false", "max_target_length=128")
  its = make_iterators(cfg, mesh_of(cfg, 4))
  epochs = [[its.tokenizer.decode(r) for b in take_batches(its.train, 3) for r in b["inputs"]] for _ in range(2)]
  assert sorted(epochs[0]) == sorted(DOCS) == sorted(epochs[1]) and epochs[0] != epochs[1]


@pytest.mark.parametrize("packing, shards", [(True, 1), (False, 1), (True, 2)])
def test_grain_resume_is_exact(tmp_path, corpus, records, packing, shards):
  cfg = _grain_config(tmp_path, corpus, records, f"packing={packing}")
  mesh = mesh_of(cfg, 4)
  train = make_iterators(cfg, mesh).train
  if shards > 1:  # as two processes start (a fresh shard's state does not name the shard): one process reads both
    train.set_state({"num_shards": shards, "shards": train.get_state()["shards"] * shards})
  take_batches(train, 5)  # past the end of the first epoch
  state = json.loads(json.dumps(train.get_state()))  # as a checkpoint stores it
  expected = take_batches(train, 4)
  resumed = make_iterators(cfg, mesh).train
  resumed.set_state(state)
  assert_same_batches(take_batches(resumed, 4), expected)
  with pytest.raises(ValueError, match="damaged"):  # not one state per shard: inconsistent, so damaged
    resumed.set_state({**state, "num_shards": shards + 1})
  with pytest.raises(ValueError, match="cannot resume a global batch"):  # the user's change
    resumed.set_state({"num_shards": 3, "shards": state["shards"][:1] * 3})


def test_grain_mixture_and_parquet(tmp_path, corpus, records):
  import pyarrow as pa
  import pyarrow.parquet as pq

  root, _ = records
  assert parse_mixture("a*,3;b*,1") == [("a*", 0.75), ("b*", 0.25)] and parse_mixture("x") == [("x", 1.0)]
  for name, docs in (("first", DOCS[:6]), ("second", DOCS[6:])):
    pq.write_table(pa.table({"text": docs}), tmp_path / f"{name}.parquet", row_group_size=2)
  files = f"grain_train_files={tmp_path}/first.parquet,0.75;{tmp_path}/second.parquet,0.25"
  cfg = _grain_config(tmp_path, corpus, records, files, "grain_file_type=parquet", "packing=false")
  its = make_iterators(cfg.replace(max_target_length=128), mesh_of(cfg, 8))
  texts = [its.tokenizer.decode(r) for b in take_batches(its.train, 4) for r in b["inputs"]]
  first = sum(t in DOCS[:6] for t in texts)
  assert first == 24 and len(texts) - first == 8  # 3:1 over 32 rows


def test_grain_one_epoch_eval_counts_every_document_once(tmp_path, corpus, records):
  from MaxText import train

  root, _ = records
  cfg = _grain_config(tmp_path, corpus, records, f"grain_eval_files={root}/eval-*", "packing=false")
  cfg = cfg.replace(max_target_length=128, eval_steps=-1, eval_per_device_batch_size=1.0)
  its = make_iterators(cfg, mesh_of(cfg, 4))
  batches = [as_numpy(b) for b in its.eval_factory()]
  texts = [its.tokenizer.decode(r) for b in batches for r in b["inputs"]]
  assert len(batches) == 2 and sorted(texts) == sorted(DOCS[:7] + [""])  # 7 documents, then one padding row
  # evaluate() runs the whole epoch and counts each target token once.
  expected = sum(int((b["targets_segmentation"] != 0).sum()) for b in batches)

  def count_tokens(params, batch):
    tokens = float((np.asarray(batch["targets_segmentation"]) != 0).sum())
    return {"nll": 2.0 * tokens, "tokens": tokens}

  result = train.evaluate(cfg, count_tokens, None, its.eval_factory)
  assert result == {"eval_loss": 2.0, "eval_tokens": expected}


def test_grain_bad_input(tmp_path, corpus, records):
  mesh_cfg = _grain_config(tmp_path, corpus, records)
  for files, message in (
    (f"{tmp_path}/none-*", "none-\\*' matches no files"),
    (f"{tmp_path}/bad.array_record", "Cannot read ArrayRecord file.*bad.array_record"),
    (f"{tmp_path}/empty-*", "dataset .*empty-00000-of-00001.array_record is empty"),
    (f"{tmp_path}/field-*", "no text field 'text'"),
  ):
    (tmp_path / "bad.array_record").write_text("not an array record")
    with pytest.raises(ValueError, match=message):
      make_iterators(mesh_cfg.replace(grain_train_files=files), mesh_of(mesh_cfg, 1))
    if "bad" in files:
      from array_record.python.array_record_module import ArrayRecordWriter

      ArrayRecordWriter(str(tmp_path / "empty-00000-of-00001.array_record"), "group_size:1").close()
      w = ArrayRecordWriter(str(tmp_path / "field-00000-of-00001.array_record"), "group_size:1")
      w.write(json.dumps({"body": "x"}).encode())
      w.close()


def test_convert_command(tmp_path, corpus, records):
  (tmp_path / "in.jsonl").write_text("".join(json.dumps({"t": d}) + "\n" for d in DOCS))
  files, out = f"{tmp_path}/*.jsonl", str(tmp_path / "out")
  convert_main(["convert_to_arrayrecord.py", "--files", files, "--output_dir", out, "--text_column", "t"])
  cfg = _grain_config(tmp_path, corpus, records, f"grain_train_files={tmp_path}/out/data-*.array_record")
  its = make_iterators(cfg.replace(packing=False, max_target_length=128), mesh_of(cfg, 4))
  assert sorted(its.tokenizer.decode(r) for b in take_batches(its.train, 3) for r in b["inputs"]) == sorted(DOCS)


def _train_config(tmp_path, corpus, records, name, *overrides):
  from MaxText.tests.conftest import BASE, TINY

  root, _ = records
  grain = ["dataset_type=grain", f"grain_train_files={root}/train-*", f"tokenizer_path={corpus[1]}"]
  grain += ["grain_worker_count=0", "vocab_size=512", "per_device_batch_size=1", "async_checkpointing=false"]
  argv = [BASE, f"run_name={name}", f"base_output_directory={tmp_path}", *TINY, *grain, *overrides]
  from MaxText import config

  return config.load(argv, {})


@pytest.mark.slow  # over 40 s on 2 busy cores (2026-11-27)
def test_grain_training_resumes_exactly_and_stops_at_target_eval_loss(tmp_path, corpus, records):
  from MaxText import train

  def losses(c):
    with open(c.metrics_file) as f:
      return [r["loss"] for r in map(json.loads, f) if "loss" in r]

  common = ["enable_checkpointing=true", "checkpoint_period=2", "learning_rate_schedule_steps=4", "steps=4"]
  train.run(_train_config(tmp_path, corpus, records, "full", *common))
  train.run(_train_config(tmp_path, corpus, records, "split", *common[:-1], "steps=2"))
  # The restart evaluates one epoch after every step; target_eval_loss=100 stops it after its first step.
  evals = [f"grain_eval_files={records[0]}/eval-*", "eval_interval=1", "eval_steps=-1", "target_eval_loss=100"]
  split = _train_config(tmp_path, corpus, records, "split", *common, *evals)
  assert train.run(split)["steps_run"] == 1
  assert sorted(os.listdir(split.checkpoint_dir)) == ["2", "3"]  # checkpointed where it stopped
  full = _train_config(tmp_path, corpus, records, "full")
  assert losses(split) == losses(full)[:3]  # bit-exact: the restart saw the same batches


def test_download_dataset_prepares_local_text(tmp_path):
  import subprocess

  from MaxText.tests.conftest import ROOT

  (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
  script = os.path.join(ROOT, "download_dataset.sh")
  env = {**os.environ, "SHARDS": "3"}
  subprocess.run(["bash", script, "--text", f"{tmp_path}/*.jsonl", str(tmp_path / "out")], check=True, env=env)
  assert sorted(os.listdir(tmp_path / "out")) == [f"data-0000{i}-of-00003.array_record" for i in range(3)]
  usage = subprocess.run(["bash", script], capture_output=True, text=True)
  assert usage.returncode == 2 and "download_dataset.sh PROJECT BUCKET" in usage.stderr
