"""gs:// end to end against a local GCS emulator (MaxText/tests/gcs_emulator.py): outputs, checkpoints and
exact resume, decode from a bucket, text data and tokenizers in a bucket, converters and data tools reading
and writing a bucket, download_dataset.sh, and the one-line errors for a missing bucket and missing or bad
credentials. Every client (gcsfs through epath, tensorstore through orbax, google-cloud-storage through
TensorBoard's writer) reaches the emulator through the environment variables of gcs_env."""

import json
import os
import subprocess
import sys
import time

import pytest

from MaxText import config as config_lib
from MaxText import gcs_auth, launch, paths, plot_metrics, train
from MaxText.errors import StorageError
from MaxText.tests.conftest import BASE, DOCS, ROOT, TINY, cpu_subprocess_env, free_port, run_processes


def gcfg(base, name, *overrides):
  return config_lib.load([BASE, f"run_name={name}", f"base_output_directory={base}", *TINY, *overrides], {})


def remote_losses(c):
  return [json.loads(line)["loss"] for line in paths.Path(c.metrics_file).read_text().splitlines()]


def test_path_helpers_keep_the_scheme(tmp_path):
  assert paths.absolute("gs://b/run") == "gs://b/run"
  assert paths.absolute("rel") == os.path.join(os.getcwd(), "rel")
  assert paths.join("gs://b/run", "checkpoints", "3") == "gs://b/run/checkpoints/3"
  assert paths.dirname("gs://b/run/metrics.jsonl") == "gs://b/run"
  assert paths.is_remote("gs://b") and not paths.is_remote(str(tmp_path)) and not paths.is_remote("")


def test_append_file_on_a_bucket_appends_across_opens(bucket):
  path = f"{bucket}/m/metrics.jsonl"
  for line in ("a\n", "b\n"):
    f = paths.AppendFile(path)
    f.write(line)
    f.close()
  assert paths.Path(path).read_text() == "a\nb\n"
  assert paths.local_copy(path).startswith(paths.local_dir_for(f"{bucket}/m"))


def test_missing_bucket_is_one_line_within_seconds(gcs, tmp_path):
  c = gcfg("gs://no-such-bucket-maxtext/out", "r")
  start = time.monotonic()
  with pytest.raises(StorageError, match=r"base_output_directory='gs://no-such-bucket-maxtext/out/r'.*does not"):
    launch.check_outputs(c)
  assert time.monotonic() - start < 10
  with pytest.raises(StorageError, match="no answer from storage within 0.01 s"):
    paths.with_timeout(lambda: time.sleep(1), "x", timeout_s=0.01)


def test_missing_bucket_exits_with_one_line(gcs):
  argv = [sys.executable, "MaxText/train.py", BASE, "run_name=r", "base_output_directory=gs://no-such-bucket/x", *TINY]
  env = {**cpu_subprocess_env(1), **gcs}
  result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("Storage error: base_output_directory='gs://no-such-bucket/x/r'")
  assert "Traceback" not in result.stderr


EMULATOR_VARIABLES = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT")


def no_credentials_env(tmp_path, **extra):
  """This environment without the emulator and without any way to find credentials: an empty gcloud
  configuration, no GCE metadata check (its host an unreachable local port, should the check run anyway)."""
  env = {k: v for k, v in os.environ.items() if k not in EMULATOR_VARIABLES and k != "GOOGLE_APPLICATION_CREDENTIALS"}
  os.makedirs(tmp_path / "gcloud", exist_ok=True)
  env.update(CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="true", GCE_METADATA_TIMEOUT="1")
  env.update(GCE_METADATA_HOST=f"127.0.0.1:{free_port()}", GCE_METADATA_IP=f"127.0.0.1:{free_port()}")
  return {**cpu_subprocess_env(1, base=env), **extra}


PROBE = """
import time
from MaxText import paths
from MaxText.errors import StorageError
start = time.monotonic()
try:
  paths.check_writable("gs://no-such-bucket-maxtext/out", "base_output_directory")
except StorageError as e:
  print(f"{time.monotonic() - start:.1f}", e)
"""


@pytest.mark.parametrize("key_file", ["none", "missing", "malformed"])
def test_bad_credentials_fail_within_seconds_naming_what_to_set(tmp_path, key_file):
  """No network and no real bucket: the credential lookup fails and says what to set, long before the 30 s
  storage timeout (a subprocess, so that no client state of this one is reused and nothing can hang it)."""
  extra = {}
  if key_file != "none":
    (tmp_path / "bad.json").write_text("{not json")
    extra["GOOGLE_APPLICATION_CREDENTIALS"] = str(tmp_path / ("bad.json" if key_file == "malformed" else "no.json"))
  env = no_credentials_env(tmp_path, **extra)
  result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
  elapsed, _, line = result.stdout.strip().partition(" ")
  assert line.startswith("base_output_directory='gs://no-such-bucket-maxtext/out': no usable Google Cloud"), result
  assert "gcloud auth application-default login" in line and "GOOGLE_APPLICATION_CREDENTIALS" in line
  assert float(elapsed) < 5


def test_credential_lookup_without_an_answer_is_one_line(monkeypatch):
  import google.auth

  for key in EMULATOR_VARIABLES:
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setattr(gcs_auth, "_credentials_found", False)
  monkeypatch.setattr(gcs_auth, "CREDENTIALS_TIMEOUT_S", 0.05)
  monkeypatch.setattr(google.auth, "default", lambda: time.sleep(1))
  with pytest.raises(StorageError, match=r"^'gs://b/x': no Google Cloud credentials found within 0.05 s; run"):
    paths.with_timeout(lambda: None, "'gs://b/x'")
  with pytest.raises(StorageError, match=r"^'gs://b/m.jsonl': no Google Cloud credentials found"):
    plot_metrics.read_records("gs://b/m.jsonl")
  paths.with_timeout(lambda: None, "'/a/local/path'")  # local paths need no credentials
  monkeypatch.setenv("FSSPEC_GCS_TOKEN", "anon")
  paths.with_timeout(lambda: None, "'gs://public/x'")  # anonymous access asked for


def test_train_without_credentials_exits_with_one_line(tmp_path):
  argv = [sys.executable, "MaxText/train.py", BASE, "run_name=r", "base_output_directory=gs://no-such-bucket/x", *TINY]
  result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=no_credentials_env(tmp_path))
  assert result.returncode == 1
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("Storage error: base_output_directory='gs://no-such-bucket/x/r': no usable Google Cloud")
  assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_resume_and_load_on_a_bucket_are_exact(bucket):
  """Checkpoints, metrics, config and TensorBoard land in the bucket with the local layout; a resumed run
  is bit-exact with an uninterrupted one; load_parameters_path reads a gs:// checkpoint."""
  common = ["per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=3", "async_checkpointing=false"]
  common += ["learning_rate_schedule_steps=6", "enable_tensorboard=true"]
  full = gcfg(bucket, "full", "steps=6", *common)
  train.run(full)
  train.run(gcfg(bucket, "split", "steps=3", *common))
  split = gcfg(bucket, "split", "steps=6", *common)
  assert train.run(split)["steps_run"] == 3
  assert remote_losses(split) == remote_losses(full)
  assert paths.listdir(split.checkpoint_dir) == ["3", "6"]
  assert {"config.yml", "metrics.jsonl", "checkpoints", "tensorboard"} <= set(paths.listdir(split.run_dir))
  assert len(paths.listdir(split.tensorboard_dir)) == 2  # one events file per run, as locally
  state = train.checkpoint_path(split, 6)
  assert state == f"{bucket}/split/checkpoints/6/state"
  params = gcfg(bucket, "params", "steps=1", f"load_parameters_path={state}", "per_device_batch_size=1")
  train.run(params)
  assert remote_losses(params)[0] < remote_losses(full)[0]
  resumed = gcfg(bucket, "fullstate", "steps=7", f"load_full_state_path={state}", "per_device_batch_size=1")
  assert train.run(resumed)["steps_run"] == 1  # continues at step 6
  from MaxText import decode

  generated = decode.run(gcfg(bucket, "dec", f"load_parameters_path={state}", "per_device_batch_size=1"), rows=1)
  assert generated is not None


def test_text_data_tokenizer_and_cache_in_a_bucket(bucket):
  """dataset_path is a gs:// glob; the trained tokenizer and token cache are published to the run directory
  in the bucket, and a second run (with an empty local cache) reuses them; tokenizer_path takes gs://."""
  from MaxText import data as data_lib
  from MaxText import sharding

  for i, doc in enumerate(DOCS):
    paths.Path(f"{bucket}/docs/{i:02d}.txt").write_text(doc)
  text = ["dataset_type=text", f"dataset_path={bucket}/docs/*.txt", "vocab_size=512", "eval_interval=-1"]
  c = gcfg(bucket, "t", *text)
  mesh = sharding.create_mesh(c)
  first = data_lib.make_iterators(c, mesh)
  tok_dir = paths.listdir(c.tokenizer_dir)
  assert "tokenizer.model" in tok_dir and any(n.endswith(".offsets.npy") for n in tok_dir)
  batch = next(first.train)
  import shutil

  shutil.rmtree(paths.local_dir_for(c.tokenizer_dir))  # another host: nothing local, all from the bucket
  again = data_lib.make_iterators(c, mesh)
  assert (next(again.train)["inputs"] == batch["inputs"]).all()
  by_path = gcfg(bucket, "u", *text, f"tokenizer_path={c.tokenizer_dir}/tokenizer.model")
  assert data_lib.make_iterators(by_path, mesh).tokenizer.vocab_size == first.tokenizer.vocab_size


@pytest.mark.slow
def test_two_processes_without_a_shared_disk_share_the_tokenizer_through_the_bucket(bucket, tmp_path):
  """Each process has its own temporary directory (its local caches); process 0 trains the tokenizer and
  tokenizes the corpus, process 1 waits for both in the bucket; a rerun resumes from the gs:// checkpoint."""
  for i, doc in enumerate(DOCS):
    paths.Path(f"{bucket}/docs/{i:02d}.txt").write_text(doc)
  command = [sys.executable, "MaxText/train.py", BASE, "run_name=mh", f"base_output_directory={bucket}", *TINY]
  command += ["dataset_type=text", f"dataset_path={bucket}/docs/*.txt", "vocab_size=512", "eval_interval=-1"]
  command += ["enable_checkpointing=true", "async_checkpointing=false", "per_device_batch_size=1"]

  def rank_env(rank):
    os.makedirs(tmp_path / f"tmp{rank}", exist_ok=True)
    return {"TMPDIR": str(tmp_path / f"tmp{rank}")}

  for steps in (2, 3):
    results = run_processes([*command, f"steps={steps}"], ROOT, tmp_path, f"mh{steps}", 2, 2, 300, rank_env)
    for code, out in results:
      assert code == 0, out[-3000:]
  assert paths.listdir(f"{bucket}/mh/checkpoints") == ["2", "3"]
  assert len(paths.Path(f"{bucket}/mh/metrics.jsonl").read_text().splitlines()) == 3


def test_hf_to_maxtext_and_back_through_a_bucket(bucket, tmp_path):
  """hf_to_maxtext --hf_path and --output on gs://: the converted params load from the bucket as
  load_parameters_path; maxtext_to_hf reads them from the bucket and writes the same tensors to it."""
  from safetensors.numpy import load_file

  from benchmarks import convert_benchmark
  from MaxText import checkpointing
  from MaxText.convert import hf_to_maxtext, maxtext_to_hf

  local = str(tmp_path / "hf")
  convert_benchmark.write_llama(local, layers=2, emb=64, mlp=128, vocab=256, heads=4)
  for name in os.listdir(local):
    paths.Path(f"{bucket}/hf/{name}").write_bytes((tmp_path / "hf" / name).read_bytes())
  params = hf_to_maxtext.convert(f"{bucket}/hf", f"{bucket}/converted")
  assert params == f"{bucket}/converted/params"
  assert "config.yml" in paths.listdir(f"{bucket}/converted")
  assert "params" in checkpointing.saved_tree(params)
  converted = f"{bucket}/converted/config.yml"
  maxtext_to_hf.main(["maxtext_to_hf.py", converted, f"load_parameters_path={params}", "--output", f"{bucket}/back"])
  back = paths.local_copy(f"{bucket}/back")
  assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(back))
  exported = {k: v for n in os.listdir(back) if n.endswith(".safetensors") for k, v in load_file(f"{back}/{n}").items()}
  original = {
    k: v for n in os.listdir(local) if n.endswith(".safetensors") for k, v in load_file(f"{local}/{n}").items()
  }
  assert exported.keys() == original.keys() and all((exported[k] == original[k]).all() for k in original)
  with pytest.raises(SystemExit, match=r"^Conversion error: load_parameters_path .*/nothing' does not exist"):
    maxtext_to_hf.main(["maxtext_to_hf.py", converted, f"load_parameters_path={bucket}/nothing", "--output", back])


def test_download_dataset_copies_c4_to_a_bucket_and_a_local_dir(gcs, bucket, tmp_path):
  """download_dataset.sh PROJECT BUCKET and PROJECT --local DIR with C4_SOURCE a small local stand-in for the
  C4 directory and COPY=python (gsutil cannot reach the emulator): the same files land at c4/en/3.0.1."""
  source = tmp_path / "c4src"
  os.makedirs(source / "sub")
  files = {"c4-train.tfrecord-00000-of-00002": b"\x00\x01" * 1000, "dataset_info.json": b"{}", "sub/x.json": b"[]"}
  for name, data in files.items():
    (source / name).write_bytes(data)
  env = {**os.environ, **gcs, "C4_SOURCE": str(source), "COPY": "python"}
  script = os.path.join(ROOT, "download_dataset.sh")
  run = subprocess.run(
    ["bash", script, "my-project", f"{bucket}/"], capture_output=True, text=True, env=env, timeout=120
  )
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip().endswith(f"C4 in {bucket}/c4/en/3.0.1")
  assert paths.files_under(f"{bucket}/c4/en/3.0.1") == sorted(files)
  assert all(paths.Path(f"{bucket}/c4/en/3.0.1/{n}").read_bytes() == data for n, data in files.items())
  local = tmp_path / "local"
  env["C4_SOURCE"] = f"{bucket}/c4/en/3.0.1"  # and back from the bucket
  run = subprocess.run(
    ["bash", script, "p", "--local", str(local)], capture_output=True, text=True, env=env, timeout=120
  )
  assert run.returncode == 0, run.stderr
  assert all((local / "c4/en/3.0.1" / n).read_bytes() == data for n, data in files.items())
  env["C4_SOURCE"] = f"{bucket}/nothing"
  run = subprocess.run(["bash", script, "p", bucket], capture_output=True, text=True, env=env, timeout=120)
  assert run.returncode == 1 and run.stderr.strip() == f"Storage error: '{bucket}/nothing' is not a directory"


def test_data_tools_read_and_write_a_bucket(bucket, tmp_path):
  """train_tokenizer and convert_to_arrayrecord with --files and --output_dir on gs://; grain reads the result."""
  from grain.sources import ArrayRecordDataSource

  from MaxText.data import convert_to_arrayrecord, train_tokenizer
  from MaxText.data.tokenizer import load_tokenizer

  for i, doc in enumerate(DOCS):
    paths.Path(f"{bucket}/docs/{i:02d}.txt").write_text(doc)
  train_tokenizer.main(
    ["train_tokenizer.py", "--files", f"{bucket}/docs/*.txt", "--vocab_size", "300", "--output_dir", f"{bucket}/tok"]
  )
  assert load_tokenizer(f"{bucket}/tok/tokenizer.model").vocab_size <= 300
  convert_to_arrayrecord.main(
    [
      "convert_to_arrayrecord.py",
      "--files",
      f"{bucket}/docs/*.txt",
      "--output_dir",
      f"{bucket}/ar",
      "--num_shards",
      "2",
    ]
  )
  assert paths.listdir(f"{bucket}/ar") == [f"data-0000{i}-of-00002.array_record" for i in range(2)]
  source = ArrayRecordDataSource([f"{bucket}/ar/{name}" for name in paths.listdir(f"{bucket}/ar")])
  assert len(source) == len(DOCS)
