"""Inputs read from gs:// against the local GCS emulator (conftest's gcs fixtures): every data pipeline gives
the same batches from a bucket as from the same files on disk (grain ArrayRecord and Parquet, TFDS, Hugging
Face local-file formats), and the files other entry points read: compiled_trainstep_file, golden logits, the
config.yml and checkpoints the saved-config check compares with."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from MaxText import config as config_lib
from MaxText import paths
from MaxText.data import make_iterators
from MaxText.data.convert_to_arrayrecord import write_arrayrecord
from MaxText.errors import ConfigError
from MaxText.tests.conftest import (
  BASE,
  DOCS,
  TINY,
  assert_same_batches,
  data_config,
  hf_offline,
  losses,
  mesh_of,
  take_batches,
)


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


def test_hf_parquet_and_json_files_on_a_bucket(tmp_path, corpus, bucket, monkeypatch):
  hf_offline(monkeypatch, offline=False)  # the emulator is local, but datasets cannot tell
  os.makedirs(tmp_path / "hf")
  pq.write_table(pa.table({"text": DOCS}), tmp_path / "hf" / "train.parquet")
  (tmp_path / "hf" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
  upload(tmp_path / "hf", f"{bucket}/hf")
  for kind, name in (("parquet", "*.parquet"), ("json", "train.jsonl")):
    hf = ["dataset_type=hf", f"hf_path={kind}"]
    same_batches(
      tmp_path, corpus, [*hf, f"hf_train_files={tmp_path}/hf/{name}"], [*hf, f"hf_train_files={bucket}/hf/{name}"]
    )


def gcfg(base, name, *overrides):
  return config_lib.load([BASE, f"run_name={name}", f"base_output_directory={base}", *TINY, *overrides], {})


def test_compiled_trainstep_file_on_a_bucket(tmp_path, bucket):
  """train_compile's executable written to gs:// is read from there by train.py (train_compile_test checks its
  losses against the jitted step's)."""
  from MaxText import compiled_step, train, train_compile

  path, common = f"{bucket}/aot/step.pickle", ["steps=2", "per_device_batch_size=1"]
  c = gcfg(tmp_path, "compile", *common, "compile_topology=cpu", f"compiled_trainstep_file={path}")
  compiled, _, mesh = train_compile.compile_train_step(c, train_compile.topology_devices(c))
  compiled_step.save_compiled(path, compiled, c, mesh)
  loaded = gcfg(tmp_path, "loaded", *common, f"compiled_trainstep_file={path}")
  assert train.run(loaded)["steps_run"] == 2 and np.isfinite(losses(loaded)).all()
  with pytest.raises(ConfigError, match="does not exist"):
    train.run(gcfg(tmp_path, "missing", *common, f"compiled_trainstep_file={bucket}/aot/nope.pickle"))


def test_check_logits_reads_golden_logits_and_params_from_a_bucket(bucket):
  """check_logits with load_parameters_path and golden_logits_path both on gs://: passes on the model's own
  logits, fails on shifted ones."""
  from MaxText import check_logits, checkpointing
  from MaxText import state as state_lib

  params, argv = f"{bucket}/params", [BASE, *TINY, "run_name=check", f"base_output_directory={bucket}"]
  c = config_lib.load([*argv, "dtype=float32", "weight_dtype=float32"], {})
  checkpointing.save_params(params, state_lib.init_params(c, state_lib.param_spec(c)))
  argv.append(f"load_parameters_path={params}")
  run = check_logits.model_logits(c.replace(load_parameters_path=params))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
  for name, shift in (("golden", 0.0), ("bad", 1e-2)):
    rows = [json.dumps({"tokens": t.tolist(), "logits": (run(t) + shift).tolist()}) for t in tokens]
    paths.Path(f"{bucket}/{name}.jsonl").write_text("\n".join(rows) + "\n")
  check_logits.main(["check_logits.py", *argv, f"golden_logits_path={bucket}/golden.jsonl"])  # within tolerance
  with pytest.raises(SystemExit) as e:
    check_logits.main(["check_logits.py", *argv, f"golden_logits_path={bucket}/bad.jsonl", "atol=1e-3", "rtol=0"])
  assert e.value.code == 1


def test_saved_config_check_reads_runs_and_checkpoints_in_a_bucket(bucket):
  """saved_config.check names the differing keys for a gs:// run to resume and gs:// load paths, from the
  saved config.yml or, without one, from the checkpoint's parameter shapes."""
  import jax
  import yaml

  from MaxText import checkpointing, saved_config
  from MaxText import state as state_lib

  paths.Path(f"{bucket}/runs/old/config.yml").write_text(yaml.safe_dump({"base_emb_dim": 128}))
  paths.Path(f"{bucket}/runs/old/checkpoints/1/state/_CHECKPOINT_METADATA").write_text("{}")
  with pytest.raises(
    ConfigError, match=r"run_name='old' has checkpoints of another architecture.*base_emb_dim: 128 -> 64"
  ):
    saved_config.check(gcfg(f"{bucket}/runs", "old", "enable_checkpointing=true"))
  saved_config.check(gcfg(f"{bucket}/runs", "old", "enable_checkpointing=true", "base_emb_dim=128"))  # agrees
  state = f"load_parameters_path={bucket}/runs/old/checkpoints/1/state"
  with pytest.raises(ConfigError, match=r"load_parameters_path=.* another architecture \(per gs://.*/old/config.yml"):
    saved_config.check(gcfg(f"{bucket}/runs", "new", state))
  wide = config_lib.load([BASE, *TINY, "base_emb_dim=128"], {})
  abstract = state_lib.param_spec(wide).abstract
  checkpointing.save_params(f"{bucket}/params128", jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract))
  with pytest.raises(ConfigError, match=r"parameter shapes saved -> wanted"):
    saved_config.check(gcfg(f"{bucket}/runs", "new", f"load_parameters_path={bucket}/params128"))
