"""dataset_type=tfds (MaxText/data/tfds_data.py) on a tiny array_record TFDS dataset built here (no TensorFlow)."""

import json

import pytest

from MaxText.data import make_iterators
from MaxText.tests.conftest import DOCS, assert_same_batches, check_batch, data_config, mesh_of, take_batches


def test_tfds_batches_eval_and_resume(tmp_path, corpus, tfds_data_dir):
  overrides = ["dataset_type=tfds", "dataset_name=tiny_docs:1.0.0", f"dataset_path={tfds_data_dir}", "eval_steps=-1"]
  cfg = data_config(tmp_path, *overrides, f"tokenizer_path={corpus[1]}", "grain_worker_count=0", "packing=false")
  cfg = cfg.replace(max_target_length=128)
  mesh = mesh_of(cfg, 4)
  its = make_iterators(cfg, mesh)
  epoch = [its.tokenizer.decode(r) for _ in range(3) for r in check_batch(next(its.train), cfg, mesh, 4)["inputs"]]
  assert sorted(epoch[:9]) == sorted(DOCS[:9])  # one epoch of the train split, then the next begins
  evals = [its.tokenizer.decode(r) for b in its.eval_factory() for r in b["inputs"]]
  assert sorted(evals) == sorted(["", *DOCS[9:]])  # one epoch: 3 documents and a padding row
  state = json.loads(json.dumps(its.train.get_state()))
  expected = take_batches(its.train, 2)
  resumed = make_iterators(cfg, mesh).train
  resumed.set_state(state)
  assert_same_batches(take_batches(resumed, 2), expected)
  with pytest.raises(ValueError, match="Cannot open the TFDS dataset 'tiny_docs:1.0.0' split 'test'"):
    make_iterators(cfg.replace(eval_split="test"), mesh)
