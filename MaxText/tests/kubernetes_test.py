"""multihost_job.py --PLATFORM=jobset (MaxText/launchers/kubernetes.py): golden JobSet manifests for a v5e-256 x 2
TPU job and a 4-node H100 (A3 Mega) job, checked against JobSet's CRD schema (its pod template is Kubernetes'
PodTemplateSpec; vendored and trimmed in fixtures/k8s/), read by kubectl where it is installed, and the
environment each pod would get fed to MaxText/distributed.py. UPDATE_GOLDENS=1 rewrites the golden files."""

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import types

import pytest
import yaml

import multihost_job
from MaxText import distributed
from MaxText.launchers import kubernetes
from MaxText.tests.conftest import ROOT

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "k8s", "jobset_v1alpha2.schema.json")
JOBS = {
  "jobset_tpu_v5e-256x2.yaml": [
    "--PLATFORM=jobset", "--RUN_NAME=tpu-job", "--TPU_TYPE=v5litepod-256", "--NUM_SLICES=2", "--MAX_RESTARTS=3",
    "--IMAGE=us-docker.pkg.dev/my-project/maxtext/maxtext:tpu",
    "--COMMAND=python3 MaxText/train.py v5e/16b run_name=tpu-job base_output_directory=gs://my-bucket/runs "
    "dcn_data_parallelism=2",
  ],
  "jobset_gpu_h100x4.yaml": [
    "--PLATFORM=jobset", "--DEVICE=gpu", "--RUN_NAME=gpu-job", "--NUM_NODES=4", "--MACHINE_TYPE=a3-megagpu-8g",
    "--NAMESPACE=training", "--IMAGE=us-docker.pkg.dev/my-project/maxtext/maxtext:gpu",
    "--COMMAND=python3 MaxText/train.py gpu/a3mega-llama2-7b run_name=gpu-job hardware=gpu "
    "base_output_directory=gs://my-bucket/runs dcn_data_parallelism=4",
  ],
}  # fmt: skip


def dry_run(argv, capsys):
  """multihost_job.main in this process: (exit status, manifest text, the kubectl command it would run)."""
  with pytest.raises(SystemExit) as exit_info:
    multihost_job.main(["multihost_job.py", "--DRY_RUN", *argv])
  out = capsys.readouterr().out
  text = re.search(r"^# file: \S+\n(.*)\n# end of file", out, re.S | re.M).group(1) + "\n"
  return exit_info.value.code, text, re.search(r"^# run: (.*)$", out, re.M).group(1)


@pytest.mark.parametrize("golden", sorted(JOBS))
def test_dry_run_matches_golden(golden, capsys):
  status, text, run = dry_run(JOBS[golden], capsys)
  assert status == 0
  path = os.path.join(GOLDEN, golden)
  if os.environ.get("UPDATE_GOLDENS"):
    with open(path, "w") as f:
      f.write(text)
  with open(path) as f:
    assert text == f.read()
  assert run.startswith("kubectl apply -f ") and "jobset.yaml" in run
  assert run.endswith("--namespace=training") == ("gpu" in golden)


def test_the_command_line_prints_the_manifest():
  """The real script, as a user runs it: the TPU golden from a subprocess."""
  argv = [sys.executable, "multihost_job.py", "--DRY_RUN", *JOBS["jobset_tpu_v5e-256x2.yaml"]]
  out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
  with open(os.path.join(GOLDEN, "jobset_tpu_v5e-256x2.yaml")) as f:
    assert f.read() in out


def strict(node):
  """Kubernetes rejects unknown fields (kubectl's default --validate=strict): so does the checked schema."""
  if isinstance(node, dict):
    node = {k: strict(v) for k, v in node.items()}
    if "properties" in node and "additionalProperties" not in node:
      if not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
  elif isinstance(node, list):
    node = [strict(v) for v in node]
  return node


@pytest.fixture(scope="module")
def validator():
  jsonschema = pytest.importorskip("jsonschema", reason="TEST=1 bash setup.sh installs it")
  with open(SCHEMA) as f:
    schema = strict(json.load(f))
  return jsonschema.Draft202012Validator(schema)


def golden(name):
  with open(os.path.join(GOLDEN, name)) as f:
    return yaml.safe_load(f)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_goldens_match_the_jobset_and_pod_schemas(validator, name):
  errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(golden(name))]
  assert not errors


def test_the_schema_check_catches_mistakes(validator):
  """A misspelt pod field, a replica count as a string and a bad env entry are all errors."""
  doc = golden("jobset_tpu_v5e-256x2.yaml")
  job = doc["spec"]["replicatedJobs"][0]
  pod = job["template"]["spec"]["template"]["spec"]
  pod["nodeSelectr"] = pod.pop("nodeSelector")
  job["replicas"] = "2"
  pod["containers"][0]["env"][0]["valueFrom"] = {"fieldRef": {}}  # fieldPath is required
  messages = " ".join(e.message for e in validator.iter_errors(doc))
  assert "nodeSelectr" in messages and "'2' is not of type 'integer'" in messages and "'fieldPath'" in messages


def pod_environment(doc, job_index, completion_index):
  """The environment of one pod as Kubernetes would build it: annotations through fieldRef, then $(VAR)
  expansion of the entries above, then the container script's first line run by bash (the rank)."""
  annotations = {"jobset.sigs.k8s.io/job-index": job_index}
  annotations["batch.kubernetes.io/job-completion-index"] = completion_index
  container = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
  env = {}
  for entry in container["env"]:
    if "valueFrom" in entry:
      key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", entry["valueFrom"]["fieldRef"]["fieldPath"]).group(1)
      env[entry["name"]] = str(annotations[key])
    else:
      env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], entry["value"])
  prelude = container["command"][2].splitlines()[1]  # after `set -uo pipefail`: the rank (TPU) or XLA flags
  script = f'{prelude}\necho "$NODE_RANK"' if "NODE_RANK" in prelude else 'echo "$NODE_RANK"'
  rank = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
  return {**env, "NODE_RANK": rank.strip()}


@pytest.mark.parametrize(
  "name, hardware, pods",
  [
    ("jobset_tpu_v5e-256x2.yaml", "tpu", [(0, 0), (0, 63), (1, 0), (1, 63)]),
    ("jobset_gpu_h100x4.yaml", "gpu", [(0, 0), (0, 3)]),
  ],
)
def test_every_pod_joins_jax_distributed_with_its_own_rank(name, hardware, pods):
  """distributed.plan on each pod's environment: one job of NNODES processes, ranks in slice-major order,
  the coordinator at the DNS name of the first pod of the first job (JobSet's headless service)."""
  doc = golden(name)
  jobset, job = doc["metadata"]["name"], doc["spec"]["replicatedJobs"][0]
  per_job = job["template"]["spec"]["parallelism"]
  config = types.SimpleNamespace(hardware=hardware)
  for job_index, completion_index in pods:
    env = pod_environment(doc, job_index, completion_index)
    plan = distributed.plan(config, env)
    assert plan.how == "env"
    assert plan.kwargs["coordinator_address"] == f"{jobset}-{job['name']}-0-0.{jobset}:{env['JAX_COORDINATOR_PORT']}"
    assert plan.kwargs["num_processes"] == job["replicas"] * per_job
    assert plan.kwargs["process_id"] == job_index * per_job + completion_index
    if hardware == "tpu":
      assert env["MEGASCALE_SLICE_ID"] == str(job_index) and env["MEGASCALE_NUM_SLICES"] == str(job["replicas"])
    else:
      assert plan.kwargs["local_device_ids"] == list(range(8))


@pytest.mark.parametrize(
  "tpu_type, expected",
  [
    ("v5litepod-256", ("tpu-v5-lite-podslice", "16x16", 64, 4)),
    ("v5litepod-8", ("tpu-v5-lite-podslice", "2x4", 1, 8)),
    ("v6e-16", ("tpu-v6e-slice", "4x4", 4, 4)),
    ("v5p-128", ("tpu-v5p-slice", "4x4x4", 16, 4)),
    ("v4-8", ("tpu-v4-podslice", "2x2x1", 1, 4)),
  ],
)
def test_tpu_slices_as_gke_schedules_them(tpu_type, expected):
  assert tuple(kubernetes.tpu_slice(tpu_type)) == expected


def test_bad_input_is_one_line(capsys):
  for argv, message in [
    (["--TPU_TYPE=v5litepod-12"], "v5e sizes are"),
    (["--DEVICE=gpu", "--MACHINE_TYPE=n1-standard-8"], "a3-megagpu-8g"),
  ]:
    with pytest.raises(SystemExit) as exit_info:
      multihost_job.main(["multihost_job.py", "--PLATFORM=jobset", "--RUN_NAME=x", "--IMAGE=i", "--COMMAND=1", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
  for argv, message in [([], "needs --IMAGE"), (["--IMAGE=i", "--BUCKET_NAME=b"], "takes no --BUCKET_NAME")]:
    with pytest.raises(SystemExit):
      multihost_job.parse_args(["--PLATFORM=jobset", "--RUN_NAME=x", "--COMMAND=true", *argv])
    assert message in capsys.readouterr().err


class _FakeApiServer(http.server.BaseHTTPRequestHandler):
  """The discovery answers kubectl needs to map kind JobSet to its resource (no OpenAPI, no objects: every
  other GET is 404 Not Found); the paths asked for are kept in `server.asked`."""

  GROUP_VERSION = "jobset.x-k8s.io/v1alpha2"
  JOBSETS = {"name": "jobsets", "singularName": "jobset", "namespaced": True, "kind": "JobSet", "verbs": ["get"]}
  ANSWERS = {
    "/api": {"kind": "APIVersions", "versions": ["v1"]},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": []},
    "/apis": {
      "kind": "APIGroupList",
      "groups": [
        {
          "name": "jobset.x-k8s.io",
          "versions": [{"groupVersion": GROUP_VERSION, "version": "v1alpha2"}],
          "preferredVersion": {"groupVersion": GROUP_VERSION, "version": "v1alpha2"},
        }
      ],
    },
    f"/apis/{GROUP_VERSION}": {"kind": "APIResourceList", "groupVersion": GROUP_VERSION, "resources": [JOBSETS]},
  }

  def do_GET(self):
    path = self.path.split("?")[0]
    self.server.asked.append(path)
    body = self.ANSWERS.get(path, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
    data = json.dumps(body).encode()
    self.send_response(200 if path in self.ANSWERS else 404)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def log_message(self, *args):
    pass


@pytest.fixture
def kubeconfig(tmp_path):
  """A kubeconfig whose cluster is a _FakeApiServer on 127.0.0.1; yields (path, server)."""
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApiServer)
  server.asked = []
  threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
  config = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    "users": [{"name": "fake", "user": {}}],
    "current-context": "fake",
  }
  (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
  yield str(tmp_path / "kubeconfig"), server
  server.shutdown()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", sorted(JOBS))
def test_kubectl_apply_dry_run_reads_the_goldens(name, kubeconfig, tmp_path):
  """`kubectl apply --dry-run=client` asks an API server even so: which resource a kind is (discovery), whether
  the object exists, and (unless --validate=false) the OpenAPI schemas to validate against. With no server it
  fails (connection refused); against a stand-in that answers discovery only, kubectl takes each golden as a
  namespaced JobSet, looks it up where it would create it and prints it back unchanged. The schema itself is
  checked by the jsonschema tests above, not here."""
  path, server = kubeconfig
  command = ["kubectl", "apply", "--dry-run=client", "--validate=false", "-o", "json", "-f", os.path.join(GOLDEN, name)]
  env = {**os.environ, "KUBECONFIG": path, "HOME": str(tmp_path)}  # HOME: kubectl's discovery cache
  out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
  assert out.returncode == 0, out.stderr
  applied, expected = json.loads(out.stdout), golden(name)
  last_applied = json.loads(applied["metadata"]["annotations"].pop("kubectl.kubernetes.io/last-applied-configuration"))
  for doc in (applied, expected, last_applied):  # kubectl fills in `annotations: {}` and the namespace
    doc["metadata"]["annotations"] = doc["metadata"].get("annotations") or {}
    doc["metadata"].setdefault("namespace", "default")
  assert applied == expected and last_applied == expected
  namespace = expected["metadata"]["namespace"]
  assert f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets/{expected['metadata']['name']}" in server.asked


@pytest.mark.parametrize("kubectl_status", [0, 1])
def test_submission_writes_the_manifest_and_applies_it(kubectl_status, tmp_path, monkeypatch, capsys):
  """Without --DRY_RUN: the manifest is written and `kubectl apply -f` runs on it (a stand-in kubectl on PATH
  records its arguments and the file); kubectl's failure is the exit status."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "kubectl").write_text(
    f'#!/bin/bash\necho "$@" > {tmp_path}/argv\ncp "$3" {tmp_path}/applied.yaml\nexit {kubectl_status}\n'
  )
  (bin_dir / "kubectl").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
  monkeypatch.setattr(multihost_job.tempfile, "tempdir", str(tmp_path))  # where the manifest is written
  with pytest.raises(SystemExit) as exit_info:
    multihost_job.main(["multihost_job.py", *JOBS["jobset_gpu_h100x4.yaml"]])
  assert exit_info.value.code == kubectl_status
  manifest = f"{tmp_path}/multihost_job_gpu-job/jobset.yaml"
  assert (tmp_path / "argv").read_text().split() == ["apply", "-f", manifest, "--namespace=training"]
  with open(os.path.join(GOLDEN, "jobset_gpu_h100x4.yaml")) as f:
    assert (tmp_path / "applied.yaml").read_text() == f.read()
  out = capsys.readouterr().out
  assert ("kubectl logs -f -l batch.kubernetes.io/job-name=gpu-job-node-0," in out) == (kubectl_status == 0)


def test_sigterm_to_the_container_shell_reaches_the_command(tmp_path):
  """Kubernetes stops a pod with SIGTERM to its PID 1, the container's shell: the command (here a stand-in for
  train.py that saves and exits 75 on SIGTERM) must get it, and its status is the container's."""
  saved = tmp_path / "saved"
  command = (
    "python3 -c 'import signal, sys, time\n"
    f'signal.signal(signal.SIGTERM, lambda *a: (open("{saved}", "w").write("checkpoint"), sys.exit(75)))\n'
    'print("ready", flush=True)\ntime.sleep(60)\''
  )
  args = types.SimpleNamespace(DEVICE="gpu", COMMAND=command)
  shell = subprocess.Popen(
    ["bash", "-c", kubernetes.container_script(args)], cwd=ROOT, stdout=subprocess.PIPE, text=True
  )
  assert shell.stdout.readline() == "ready\n"
  shell.terminate()
  assert shell.wait(timeout=30) == 75
  assert saved.read_text() == "checkpoint"
