"""dataset_type=hf (MaxText/data/hf_data.py) offline on local files: parquet and json, eval split, errors."""

import json

import pytest

from MaxText.data import make_iterators
from MaxText.tests.conftest import (
  DOCS,
  assert_same_batches,
  check_batch,
  data_config,
  decoded_segments,
  hf_offline,
  mesh_of,
  take_batches,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
  hf_offline(monkeypatch)


def _hf_config(tmp_path, corpus, *overrides):
  return data_config(tmp_path, "dataset_type=hf", f"tokenizer_path={corpus[1]}", "grain_worker_count=0", *overrides)


def test_hf_parquet_batches_and_resume(tmp_path, corpus):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"text": DOCS[:8]}), tmp_path / "train.parquet")
  pq.write_table(pa.table({"text": DOCS[8:]}), tmp_path / "eval.parquet")
  files = [f"hf_train_files={tmp_path}/train.parquet", f"hf_eval_files={tmp_path}/eval.parquet"]
  cfg = _hf_config(tmp_path, corpus, "hf_path=parquet", *files, "eval_steps=-1")
  mesh = mesh_of(cfg, 4)
  its = make_iterators(cfg, mesh)
  pieces = [p for _ in range(2) for p in decoded_segments(check_batch(next(its.train), cfg, mesh, 4), its.tokenizer)]
  assert all(any(piece in doc for doc in DOCS[:8]) for piece, *_ in pieces)
  state = json.loads(json.dumps(its.train.get_state()))
  expected = take_batches(its.train, 2)
  resumed = make_iterators(cfg, mesh).train
  resumed.set_state(state)
  assert_same_batches(take_batches(resumed, 2), expected)
  evals = "".join(its.tokenizer.decode(r) for b in its.eval_factory() for r in b["inputs"])
  assert all(doc in evals or doc[:20] in evals for doc in DOCS[8:])


def test_hf_json_column_and_errors(tmp_path, corpus):
  (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
  cfg = _hf_config(tmp_path, corpus, "hf_path=json", f"hf_train_files={tmp_path}/d.jsonl", "text_column=body")
  its = make_iterators(cfg.replace(packing=False, max_target_length=128), mesh_of(cfg, 4))
  assert sorted(its.tokenizer.decode(r) for b in take_batches(its.train, 3) for r in b["inputs"]) == sorted(DOCS)
  with pytest.raises(ValueError, match="no text field 'text'"):
    make_iterators(cfg.replace(text_column="text"), mesh_of(cfg, 1))
  with pytest.raises(ValueError, match="nothing.jsonl' matches no files"):
    make_iterators(cfg.replace(hf_train_files=f"{tmp_path}/nothing.jsonl"), mesh_of(cfg, 1))
  with pytest.raises(ValueError, match="Cannot load the Hugging Face dataset hf_path='no_such/dataset'"):
    make_iterators(cfg.replace(hf_path="no_such/dataset", hf_train_files=""), mesh_of(cfg, 1))
