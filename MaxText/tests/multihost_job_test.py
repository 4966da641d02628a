"""multihost_job.py: --DRY_RUN output against golden files (2-slice TPU job, 2-node Vertex GPU job) and
the code upload against a local GCS emulator. UPDATE_GOLDENS=1 rewrites the golden files."""

import io
import os
import socket
import subprocess
import sys
import tarfile
import tempfile

import pytest

from MaxText.tests.conftest import ROOT

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
TRAIN = "python3 MaxText/train.py MaxText/configs/base.yml run_name={run}"
JOBS = {
  "multihost_job_tpu.txt": [
    "--RUN_NAME=tpu-job", "--BUCKET_NAME=gs://my-bucket", "--TPU_TYPE=v5litepod-256", "--NUM_SLICES=2",
    "--ZONE=us-east5-b", "--PROJECT=my-project", "--CQR_EXTRA_ARGS=--best-effort",
    "--COMMAND=DEVICE=tpu bash setup.sh && " + TRAIN.format(run="tpu-job") + " dcn_data_parallelism=2",
  ],
  "multihost_job_vertex.txt": [
    "--PLATFORM=vertex", "--RUN_NAME=gpu-job", "--BUCKET_NAME=my-bucket", "--NUM_NODES=2", "--PROJECT=my-project",
    "--REGION=us-central1", "--IMAGE=us-docker.pkg.dev/my-project/jax/jax-gpu:latest",
    "--COMMAND=bash end_to_end/gpu/launch.sh " + TRAIN.format(run="gpu-job")[len("python3 MaxText/train.py ") :],
  ],
}  # fmt: skip


def dry_run(args, script_dir):
  command = [sys.executable, "multihost_job.py", "--DRY_RUN", f"--SCRIPT_DIR={script_dir}", *args]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  out = result.stdout.replace(str(script_dir), "<SCRIPT_DIR>")
  return out.replace(os.path.join(tempfile.gettempdir(), "multihost_job_"), "<TMP>/multihost_job_")


@pytest.mark.parametrize("golden", sorted(JOBS))
def test_dry_run_matches_golden(tmp_path, golden):
  got = dry_run(JOBS[golden], tmp_path)
  path = os.path.join(GOLDEN, golden)
  if os.environ.get("UPDATE_GOLDENS"):
    with open(path, "w") as f:
      f.write(got)
  with open(path) as f:
    assert got == f.read()


def test_vertex_needs_an_image(tmp_path):
  args = ["--PLATFORM=vertex", "--RUN_NAME=x", "--BUCKET_NAME=b", "--COMMAND=true", "--DRY_RUN"]
  result = subprocess.run([sys.executable, "multihost_job.py", *args], cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 2 and "--IMAGE" in result.stderr


@pytest.fixture
def gcs(monkeypatch):
  """A GCS emulator on 127.0.0.1 with one bucket; the storage client finds it through STORAGE_EMULATOR_HOST."""
  server_lib = pytest.importorskip("gcp_storage_emulator.server", reason="TEST=1 bash setup.sh installs it")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  server = server_lib.create_server("127.0.0.1", port, in_memory=True, default_bucket="my-bucket")
  server.start()
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
  yield
  server.stop()


def test_code_upload_to_gcs(tmp_path, gcs):
  from google.auth.credentials import AnonymousCredentials
  from google.cloud import storage

  import multihost_job

  code = tmp_path / "code"
  (code / "MaxText").mkdir(parents=True)
  (code / "MaxText" / "train.py").write_text("print('hi')\n")
  (code / ".git").mkdir()
  (code / ".git" / "HEAD").write_text("ref\n")
  args = multihost_job.parse_args(["--RUN_NAME=up", "--BUCKET_NAME=gs://my-bucket", "--COMMAND=true"])
  args.SCRIPT_DIR = str(code)
  archive = str(tmp_path / "code.tar.gz")
  multihost_job.make_archive(args.SCRIPT_DIR, archive)
  multihost_job.upload(args, archive)

  client = storage.Client(project="test", credentials=AnonymousCredentials())
  data = client.bucket("my-bucket").blob("up/code/up.tar.gz").download_as_bytes()
  with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    names = tar.getnames()
    assert tar.extractfile("./MaxText/train.py").read() == b"print('hi')\n"
  assert not any(".git" in n for n in names)
