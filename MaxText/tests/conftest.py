"""Tests run on 8 fake CPU devices; XLA_FLAGS must be set before jax is imported. Also what several test
modules share: the tiny training config (TINY, cfg, losses), the data fixtures (a small corpus and its
tokenizer, batch checks, meshes over the first N devices), and the helpers that run an entry point as
several cooperating processes on 127.0.0.1 (multihost_test, decode_test). Plain helpers that fewer modules
share live in helpers.py. Test modules import from these two, never from each other (structure_test checks)."""

import atexit
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid

# The tests' programs are tiny: XLA:CPU's compile, not their run, is most of the suite's time. These two flags
# skip LLVM's costly optimisation passes (about a quarter less CPU time; benchmarks/README.md, "Test suite").
# XLA's own passes run as before, so what a test checks (shardings, fusions, memory, equal losses across
# layouts) is unchanged; a float may differ in its last bit from a run without them (FMA contraction), which
# is why end_to_end/cpu/loss_fingerprint.py, which compares bit for bit, does not use them.
# MAXTEXT_TEST_FAST_COMPILE=0 runs the tests with XLA's default optimisation.
FAST_COMPILE = os.environ.get("MAXTEXT_TEST_FAST_COMPILE", "1") != "0"
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def cpu_xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test's CPU subprocess: `devices` fake CPU devices, compiled as the tests compile."""
  return f"--xla_force_host_platform_device_count={devices}" + (f" {FAST_COMPILE_FLAGS}" if FAST_COMPILE else "")


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # subprocesses set their own
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Scripts the tests run (end_to_end/*.sh, download_dataset.sh) call `python3`: the interpreter running
# the tests, also where pytest was started without activating its venv (.venv/bin/python -m pytest).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import jax  # noqa: E402 (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from MaxText import config, sharding  # noqa: E402
from MaxText.data import FIELDS  # noqa: E402
from MaxText.data import tokenizer as tokenizers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One persistent compilation cache per test session, shared by the pytest-xdist workers (they inherit
# MAXTEXT_TEST_JAX_CACHE from the process that made it): a program that several tests compile (the tiny
# model's step, each test's fresh jit of it) compiles once. Its key hashes the HLO, the compile options, the
# devices and the jax/jaxlib versions, so a hit is the same executable. Subprocesses get it only through
# COMPILE_CACHE_ENV: a compile for a TPU or GPU topology writes entries it cannot read back, and warns.
# XLA writes no dump on a hit (no_compile_cache). MAXTEXT_TEST_JAX_CACHE=DIR keeps it in DIR; =off: none.
# Only compiles of at least CACHE_MIN_COMPILE_SECONDS are written: with a size limit, jax's every write lists the
# whole directory under the lock (lru_cache.py: _evict_if_needed), so the suite's ~3,000 eager one-op compiles
# (20 ms each to redo) made each write scan thousands of entries (78 ms at 3,000) while the other worker waited.
COMPILE_CACHE = os.environ.get("MAXTEXT_TEST_JAX_CACHE", "")
if not COMPILE_CACHE:
  COMPILE_CACHE = os.environ["MAXTEXT_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="maxtext-test-jax-cache-")
  atexit.register(shutil.rmtree, COMPILE_CACHE, ignore_errors=True)
CACHE_MIN_COMPILE_SECONDS = 0.5
COMPILE_CACHE_ENV = {}
if COMPILE_CACHE != "off":
  # A size limit turns on jax's file lock: parallel processes never read an entry half written.
  COMPILE_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": COMPILE_CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(CACHE_MIN_COMPILE_SECONDS),
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 << 30),
  }
  jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)
  jax.config.update("jax_compilation_cache_max_size", 8 << 30)


def cpu_subprocess_env(devices: int, compile_cache: bool = True, base=None) -> dict[str, str]:
  """The environment of a test's CPU subprocess (train.py, a script, a process of a multi-process job): `base`
  (default this process's environment) on `devices` fake CPU devices, compiled as the in-process tests compile and
  sharing the session's compilation cache. compile_cache=False for a test that needs a compile to take its real
  time (a signal sent during it)."""
  env = {**(os.environ if base is None else base), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(devices)}
  return {**env, **COMPILE_CACHE_ENV} if compile_cache else env


# The per-host cache (accelerators.cache_dir: the measured CPU peak) lives in the session's own directory, shared by
# the workers and every train.py they start, not in the user's ~/.cache: the first process measures, the rest read.
if not os.environ.get("MAXTEXT_CACHE_DIR"):
  os.environ["MAXTEXT_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxtext-test-cache-")
  atexit.register(shutil.rmtree, os.environ["MAXTEXT_CACHE_DIR"], ignore_errors=True)

BASE = os.path.join(ROOT, "MaxText", "configs", "base.yml")
# The tiny model's sizes: D=64, N=4, K=2, H=16, F=128, L=2, V=256, T=32 (the FLOP tests count them by hand).
SIZES = [
  "base_emb_dim=64",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "base_mlp_dim=128",
  "base_num_decoder_layers=2",
  "head_dim=16",
  "vocab_size=256",
  "max_target_length=32",
]
TINY = [
  "dataset_type=synthetic",
  *SIZES,
  "dtype=float32",
  "log_config=false",
  "log_period=1",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0",
  "enable_checkpointing=false",
  "enable_tensorboard=false",
]


# A tiny DeepSeek V3 (MLA, 4 routed experts top-2 with a selection bias, one dense layer then two MoE layers);
# with SIZES and override_model_config=true.
DEEPSEEK3_TINY = [
  "model_name=deepseek3-671b", "override_model_config=true", "num_experts=4", "num_experts_per_tok=2",
  "base_moe_mlp_dim=32", "q_lora_rank=16", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8",
  "v_head_dim=8", "first_num_dense_layers=1", "base_num_decoder_layers=3", "n_routing_groups=2",
  "topk_routing_group=1", "original_max_position_embeddings=16",
]  # fmt: skip


# The `torch` tier: tests that run torch, transformers or torchvision live (the others read the references
# committed under hf_references/). Without them installed those tests skip with this one line.
TORCH_SKIP = "live Hugging Face comparisons; opt-in: TEST=1 TORCH=1 bash setup.sh, then TIER=torch"
TORCH_SKIP += " bash unit_test_and_lint.sh or -m torch"
HAS_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "torchvision"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads xdist_group into the node ids
def pytest_collection_modifyitems(config, items):
  for item in items:
    if not HAS_TORCH and item.get_closest_marker("torch"):
      item.add_marker(pytest.mark.skip(reason=TORCH_SKIP))
    if uses_own_module_fixture(item):
      item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
  # The minute-long tests first (stable: the rest keep their order). pytest-xdist hands out tests in this order as
  # workers free up, so a long test that came last ran alone while the other worker had nothing left to take.
  items.sort(key=lambda item: item.get_closest_marker("long") is None)


def uses_own_module_fixture(item) -> bool:
  """Whether the test needs a module-scoped fixture its own module defines (a converted model, a reference run).
  Under `pytest -n N --dist loadgroup` (unit_test_and_lint.sh) such tests share one worker (an xdist_group per
  module), so the fixture is built once per run, not once per worker; the other tests spread over all workers."""
  module = item.nodeid.split("::")[0]
  fixture_info = getattr(item, "_fixtureinfo", None)
  defs = fixture_info.name2fixturedefs.values() if fixture_info else ()
  return any(d[-1].scope == "module" and d[-1].baseid == module for d in defs if d)


def family_tiers(values, fast, quick=None, reference=True):
  """Parametrize's values for a per-family matrix, where each case runs the same code on another family: those in
  `fast` run in the fast tier (`quick` in the quick one too). The fast ones are chosen to reach each distinct code
  path the matrix covers (dense, MoE, MLA, local/global cycles, another cache). The others run in the slow tier
  where the matrix compares each family with an independent reference (reference=True: Hugging Face's logits or
  greedy tokens, upstream MaxText's logits), so that the whole suite checks every family against one; and in the
  nightly tier where it checks our own consistency (reference=False: a converted model trains, a fresh model's loss,
  forward = prefill = step, an upstream full state trains on, a family's stack pipelines)."""
  values = list(values)
  assert set(fast) <= set(values) and (quick is None or quick in fast), (fast, quick, values)
  rest = [pytest.mark.slow] if reference else NIGHTLY
  marks = lambda v: [pytest.mark.quick] * (v == quick) + rest * (v not in fast)  # noqa: E731
  return [pytest.param(v, marks=marks(v)) for v in values]


# The `nightly` tier: what a scheduled job runs beside the whole suite, which must fit 25 minutes on CI's 2 cores.
# Opt-in: TIER=nightly bash unit_test_and_lint.sh (pytest -m nightly; about 11 minutes on 2 cores). It holds
# - the full-size ahead-of-time compiles for TPU topologies beyond the one the whole suite keeps (llama2-7b on
#   v5e-256, train_compile_test), minutes of libtpu compile each (kimi-k2 about 260 CPU-seconds): the whole suite
#   compiles each one's reduced form (reduced_tpu_model); the full-size figures are in benchmarks/README.md;
# - the per-family consistency matrices' other families (family_tiers, reference=False), and the like in a family's
#   own module (its converted checkpoint fine-tunes with LoRA SFT, a fresh model trains, its stack pipelines, the
#   router-bias update on unrolled layers as on scanned ones). The whole suite trains the fast tier's families
#   (dense, GQA MoE, MLA MoE, a local/global cycle) from converted checkpoints, checks every family's forward against
#   Hugging Face's, and the gradients of each family with a module of its own across layouts;
# - the post-training walk-throughs (end_to_end_test: each of their stages has tests of its own in the whole suite)
#   and six of the loss fingerprint's eight cases.
NIGHTLY = [pytest.mark.nightly, pytest.mark.slow]
FULLSIZE = [*NIGHTLY, pytest.mark.long]  # a full-size compile: minutes alone, started first


def reduced_tpu_model(emb_dim: int = 256, layers: int = 1) -> tuple[str, ...]:
  """Overrides that keep what a preset or recipe chose for the step (its block, batch per chip, remat, attention,
  parallelism, dtypes) and shrink the model and the sequence, for a TPU topology's ahead-of-time compile in seconds:
  XLA:TPU's compile time grows with the per-chip shapes (its backend's code generation), not with the chips or the
  (scanned) layers. emb_dim must divide by the fsdp axis (256 on a v5e-256, 512 on a v5p-1024); 128 tokens is the
  shortest the splash kernel takes (a multiple of 128: attention_kernels.py), so flash stays on where it was."""
  return (
    "override_model_config=true", "global_parameter_scale=1", f"base_num_decoder_layers={layers}",
    f"base_emb_dim={emb_dim}", f"base_mlp_dim={2 * emb_dim}", "base_num_query_heads=4", "base_num_kv_heads=4",
    "head_dim=128", f"vocab_size={max(512, emb_dim)}", "max_target_length=128",
  )  # fmt: skip


def sized_config(tmp_path, *overrides):
  """base.yml with the tiny model's SIZES only (every other key at its default), outputs under tmp_path."""
  return config.load([BASE, "run_name=t", f"base_output_directory={tmp_path}", *SIZES, *overrides], {})


@pytest.fixture
def no_compile_cache():
  """This test's compiles skip the persistent cache (XLA writes its dumps only when it compiles)."""
  from jax.experimental.compilation_cache import compilation_cache

  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", True)
  compilation_cache.reset_cache()


def cfg(tmp_path, name, *overrides):
  return config.load([BASE, f"run_name={name}", f"base_output_directory={tmp_path}", *TINY, *overrides], {})


def losses(c):
  with open(c.metrics_file) as f:
    return [json.loads(line)["loss"] for line in f]


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def document(i: int) -> str:
  """Document i: a few (i even) or many (i odd) pseudo-random words, so rows hold both short and long ones."""
  rng = np.random.default_rng(i)
  words = rng.choice(WORDS, size=4 + (i % 2) * 60 + i)
  return f"Doc {i}: " + " ".join(words) + ".\n"


DOCS = [document(i) for i in range(12)]


def hf_offline(monkeypatch, offline: bool = True) -> None:
  """The Hugging Face libraries offline (local files only: never the network) or, offline=False, allowed out (a
  local GCS emulator looks remote to them). Both read HF_HUB_OFFLINE and HF_DATASETS_OFFLINE once, at import, so
  the variables alone come too late in a test: offline, the Hub client spent 23 s retrying a host this machine
  cannot resolve; online after a file that imported them offline, datasets refused the bucket."""
  import datasets  # noqa: PLC0415
  import huggingface_hub.constants  # noqa: PLC0415

  for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    monkeypatch.setenv(name, "1" if offline else "0")
    monkeypatch.setattr(datasets.config, name, offline)
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(docs glob, tokenizer path) shared by the tests, so each trains no tokenizer of its own."""
  root = tmp_path_factory.mktemp("corpus")
  os.makedirs(root / "docs")
  for i, doc in enumerate(DOCS):
    (root / "docs" / f"{i:02d}.txt").write_text(doc)
  model = tokenizers.train_sentencepiece(DOCS, 512, str(root / "tok"))
  return f"{root}/docs/*.txt", model


def data_argv(tmp_path, *overrides):
  base = [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", f"base_output_directory={tmp_path}"]
  return [*base, "vocab_size=512", "max_target_length=32", "per_device_batch_size=1", "eval_fraction=0", *overrides]


def data_config(tmp_path, *overrides):
  return config.load(data_argv(tmp_path, *overrides), environ={})


def text_config(tmp_path, corpus, *overrides):
  glob, model = corpus
  return data_config(tmp_path, "dataset_type=text", f"dataset_path={glob}", f"tokenizer_path={model}", *overrides)


def mesh_of(cfg, devices):
  return sharding.create_mesh(cfg, devices=jax.devices()[:devices])


def as_numpy(batch):
  return {k: np.asarray(v) for k, v in batch.items()}


def take_batches(iterator, n):
  return [as_numpy(next(iterator)) for _ in range(n)]


def assert_same_batches(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    for k in FIELDS:
      np.testing.assert_array_equal(a[k], b[k])


def check_batch(batch, cfg, mesh, global_batch):
  assert set(batch) == set(FIELDS)
  for k, v in batch.items():
    assert v.shape == (global_batch, cfg.max_target_length) and v.dtype == np.int32, k
    assert v.sharding == sharding.input_sharding(cfg, mesh), k
  b = as_numpy(batch)
  has_target = b["targets_segmentation"] != 0
  # A target is the next token of the same segment; the mask never covers padding.
  np.testing.assert_array_equal(b["targets"][:, :-1][has_target[:, :-1]], b["inputs"][:, 1:][has_target[:, :-1]])
  assert not has_target[:, -1].any() and not has_target[b["inputs_segmentation"] == 0].any()
  assert ((b["inputs_segmentation"] == 0) <= (b["inputs"] == 0)).all()
  return b


def decoded_segments(b, tok):
  """(decoded text, first token, last token, whether the last has a target) of every document piece."""
  for row in range(len(b["inputs"])):
    for seg in np.unique(b["inputs_segmentation"][row][b["inputs_segmentation"][row] > 0]):
      where = b["inputs_segmentation"][row] == seg
      ids = b["inputs"][row][where]
      np.testing.assert_array_equal(b["inputs_position"][row][where], np.arange(len(ids)))
      yield tok.decode(ids), ids[0], ids[-1], b["targets_segmentation"][row][where][-1] != 0


@pytest.fixture(scope="session")  # tfds registers the builder class by name: once per process
def tfds_data_dir(tmp_path_factory):
  """A TFDS data_dir: DOCS[:9] as split train, DOCS[9:] as validation of tiny_docs:1.0.0 (array_record files)."""
  import tensorflow_datasets as tfds

  class TinyDocs(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")
    code_path = tfds.core.Path(__file__)  # tfds would look it up through importlib_resources

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(DOCS[:9]), "validation": self._generate_examples(DOCS[9:])}

    def _generate_examples(self, docs):
      for i, doc in enumerate(docs):
        yield i, {"text": doc}

  root = tmp_path_factory.mktemp("tfds")
  TinyDocs(data_dir=str(root), file_format="array_record").download_and_prepare()
  return str(root)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(command, cwd, log_dir, name, processes, devices_per_process, timeout=300, rank_env=None):
  """Run `command` as `processes` processes of one jax.distributed job (coordinator on 127.0.0.1, CPU
  devices, gloo collectives); returns [(returncode, combined output)] in rank order. rank_env(rank): extra
  environment variables of that process (e.g. its own TMPDIR, as on a host with its own disk). The processes share
  the session's compilation cache: a program another test compiled for the same devices loads from it."""
  port = free_port()
  procs = []
  for rank in range(processes):
    env = {**cpu_subprocess_env(devices_per_process), "NNODES": str(processes), "NODE_RANK": str(rank)}
    env.update(JAX_COORDINATOR_ADDRESS="127.0.0.1", JAX_COORDINATOR_PORT=str(port))
    env.update(rank_env(rank) if rank_env else {})
    log = open(os.path.join(log_dir, f"{name}.{rank}.log"), "w+")
    procs.append((subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  results = []
  for proc, log in procs:
    proc.wait(timeout=timeout)
    log.seek(0)
    results.append((proc.returncode, log.read()))
    log.close()
  return results


GCS_BUCKET = "maxtext-test"  # the emulator's bucket (gcs_server)


@pytest.fixture(scope="session")
def gcs_server():
  """A local GCS emulator (MaxText/tests/gcs_emulator.py) on a free port, serving GCS_BUCKET, started once for
  the session; yields the environment that points the clients at it (set it with the `gcs` fixture)."""
  pytest.importorskip("gcp_storage_emulator", reason="TEST=1 bash setup.sh installs it (requirements-test.txt)")
  pytest.importorskip("gcsfs", reason="pip install -r requirements.txt")
  from MaxText.tests.gcs_emulator import gcs_env

  port = free_port()
  command = [sys.executable, os.path.join(ROOT, "MaxText", "tests", "gcs_emulator.py"), str(port), GCS_BUCKET]
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  try:
    assert proc.stdout.readline().strip() == "ready", "the GCS emulator did not start"
    yield gcs_env(port)
  finally:
    proc.kill()
    proc.wait()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
  """The emulator's environment, set in this process for one test; yields it (for subprocesses)."""
  for key, value in gcs_server.items():
    monkeypatch.setenv(key, value)
  return gcs_server


@pytest.fixture
def bucket(gcs):
  """A fresh gs:// prefix of the emulator's bucket for one test."""
  return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:8]}"
