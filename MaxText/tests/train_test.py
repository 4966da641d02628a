"""The real train loop on tiny models: sharding exactness, scan/remat equivalence, checkpoints
(resume, kill, load paths), NaN handling and early errors."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from MaxText import checkpointing, nonfinite, optimizers, sharding, train
from MaxText import data as data_lib
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.errors import ConfigError
from MaxText.tests.conftest import BASE, ROOT, TINY, cfg, losses


def run_losses(tmp_path, name, *overrides, devices=None):
  c = cfg(tmp_path, name, "steps=5", *overrides)
  train.run(c, devices)
  return losses(c)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The losses of the run the exactness tests compare against: fsdp 8 (base.yml's -1 on 8 devices), batch 2
  per device, scanned layers, remat_policy=full (base.yml's defaults), 5 steps. Trained once per module."""
  c = cfg(tmp_path_factory.mktemp("reference"), "ref", "steps=5", "per_device_batch_size=2")
  assert (c.ici_fsdp_parallelism, c.scan_layers, c.remat_policy) == (-1, True, "full")
  train.run(c)
  return losses(c)


def test_sharding_is_exact(tmp_path, reference):
  """Same global batch (16) on four meshes: per-step float32 losses equal within 5e-5 relative. Tensor parallelism
  sums its partial products in another order: by step 5 the loss stayed within 1e-5 relative on the earlier hosts,
  and moved 1.9e-5 on an AVX-512 AMD EPYC, whose XLA:CPU kernels round differently (2026-11-28); the rest stay
  under 1e-6."""
  ref = reference  # fsdp 8
  others = {
    "fsdp4_tp2": run_losses(
      tmp_path, "tp", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "per_device_batch_size=2"
    ),
    "dp2_fsdp4": run_losses(
      tmp_path, "dp", "ici_data_parallelism=2", "ici_fsdp_parallelism=4", "per_device_batch_size=2"
    ),
    "one_device": run_losses(tmp_path, "one", "per_device_batch_size=16", devices=jax.devices()[:1]),
  }
  assert len(ref) == 5
  for name, got in others.items():
    np.testing.assert_allclose(got, ref, rtol=5e-5, err_msg=name)


@pytest.mark.slow  # over 40 s on 2 busy cores (2026-11-27)
def test_scan_remat_and_accumulation_do_not_change_losses(tmp_path, reference):
  # Each remat policy rides on a run that changes something else too (a run is a compile, ~4 CPU-seconds): a
  # difference names both, and each feature still has a run that checks it.
  variants = [
    ["scan_layers=false", "remat_policy=minimal"],
    ["remat_policy=save_dot_except_mlp", "num_vocab_tiling=4"],  # logits and loss in 4 sequence pieces
    ["remat_policy=save_qkv_proj", "attention_query_chunk=8", "attention=dot_product"],  # 4 query blocks
    # remat() returns the layer unwrapped, scanned or not: no case of its own unrolled
    ["remat_policy=none", "gradient_accumulation_steps=2"],
  ]
  ref = reference  # remat_policy=full, scan_layers=true
  for i, variant in enumerate(variants):
    got = run_losses(tmp_path, f"variant{i}", "per_device_batch_size=2", *variant)
    # gradient accumulation sums the microbatches' gradients in another order: 2.2e-5 by step 5 on an AVX-512 host
    np.testing.assert_allclose(got, ref, rtol=5e-5, err_msg=str(variant))


@pytest.mark.slow  # over 40 s on 2 busy cores (2026-11-27)
def test_maxtext_remat_policies_do_not_change_losses(tmp_path, reference):
  # The attention output ("context") and host offloading (pinned_host memory exists on CPU too).
  ref = reference  # remat_policy=full
  for policy in ("minimal_flash", "save_dot_except_mlpwi", "qkv_proj_offloaded", "minimal_offloaded"):
    got = run_losses(tmp_path, policy, "per_device_batch_size=2", f"remat_policy={policy}")
    np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=policy)


@pytest.mark.quick
def test_loss_falls_and_metrics_are_complete(tmp_path):
  c = cfg(tmp_path, "m", "steps=12", "per_device_batch_size=1", "vocab_size=16", "enable_tensorboard=true")
  summary = train.run(c)
  with open(c.metrics_file) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, 13))  # steps completed, as checkpoints are named
  for key in ("loss", "perplexity", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s_per_device"):
    assert key in records[-1]
  assert records[-1]["mfu"] > 0 and records[-1]["tflops_per_s_per_device"] > 0
  assert records[-1]["loss"] < records[0]["loss"]
  assert summary["steps_run"] == 12
  assert os.listdir(c.tensorboard_dir)
  assert os.path.isfile(os.path.join(c.run_dir, "config.yml"))


def test_resume_is_exact(tmp_path):
  common = ["per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=3"]
  common += ["learning_rate_schedule_steps=6", "async_checkpointing=false"]
  full = cfg(tmp_path, "full", "steps=6", *common)
  train.run(full)
  train.run(cfg(tmp_path, "split", "steps=3", *common))
  split = cfg(tmp_path, "split", "steps=6", *common)
  summary = train.run(split)
  assert sorted(os.listdir(split.checkpoint_dir)) == ["3", "6"]
  assert summary["steps_run"] == 3
  assert losses(split) == losses(full)  # bit-exact: same params, optimizer state and data order


def test_finished_run_says_so_and_a_longer_resume_keeps_the_schedule(tmp_path, capsys):
  common = ["per_device_batch_size=1", "enable_checkpointing=true", "async_checkpointing=false"]
  common += ["enable_tensorboard=true", "learning_rate=1e-2", "cosine_learning_rate_final_fraction=0.1"]
  first = cfg(tmp_path, "r", "steps=4", *common)
  train.run(first)
  events = lambda: sorted(os.listdir(first.tensorboard_dir))  # noqa: E731
  assert len(events()) == 1
  capsys.readouterr()
  assert train.run(first) == {"steps_run": 0}
  assert "already at steps=4; pass steps=N with N > 4 to train further" in capsys.readouterr().out
  assert len(events()) == 1  # nothing logged, no (empty) events file
  longer = cfg(tmp_path, "r", "steps=7", *common)
  assert train.run(longer)["steps_run"] == 3
  out = capsys.readouterr().out
  assert "keeping that schedule" in out and "learning_rate_schedule_steps=7" in out
  with open(longer.metrics_file) as f:
    lrs = [json.loads(line)["learning_rate"] for line in f]
  assert lrs[4:] == pytest.approx([1e-3] * 3)  # past the first run's 4-step schedule: the final rate
  stretched = cfg(tmp_path, "r", "steps=9", "learning_rate_schedule_steps=9", *common)
  train.run(stretched)  # an explicit schedule length wins
  with open(stretched.metrics_file) as f:
    assert all(json.loads(line)["learning_rate"] > 1e-3 for line in list(f)[7:])
  assert len(events()) == 3


def test_load_parameters_and_full_state(tmp_path, monkeypatch):
  common = ["per_device_batch_size=1", "async_checkpointing=false"]
  src = cfg(tmp_path, "src", "steps=4", "enable_checkpointing=true", *common)
  train.run(src)
  state_dir = os.path.join(src.checkpoint_dir, "4", "state")
  params = cfg(tmp_path, "params", "steps=1", f"load_parameters_path={state_dir}", *common)
  with monkeypatch.context() as patch:  # loaded params are not first made at random: no second copy, no compile
    patch.setattr(state_lib, "init_state", lambda *_: pytest.fail("random init under load_parameters_path"))
    train.run(params)
  fresh = cfg(tmp_path, "fresh", "steps=1", *common)
  train.run(fresh)
  assert losses(params)[0] < losses(fresh)[0]  # starts from the trained parameters, at step 0
  full = cfg(tmp_path, "full", "steps=6", f"load_full_state_path={state_dir}", *common)
  assert train.run(full)["steps_run"] == 2  # continues at step 4


def test_nan_loss_stops_before_checkpointing(tmp_path, monkeypatch):
  real = steps.jit_train_step

  def poisoned(*args):
    step_fn = real(*args)

    def wrapped(state, batch, rng):
      state, metrics = step_fn(state, batch, rng)
      if int(state.step) >= 3:
        metrics = {**metrics, "loss": metrics["loss"] * float("nan")}
      return state, metrics

    return wrapped

  monkeypatch.setattr(steps, "jit_train_step", poisoned)
  c = cfg(tmp_path, "nan", "steps=6", "per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=1")
  with pytest.raises(nonfinite.NonFiniteLossError, match="step 3"):  # the third step's update made state.step 3
    train.run(c)
  assert sorted(os.listdir(c.checkpoint_dir)) == ["1", "2"]


@pytest.mark.parametrize("overrides", [[], ["scan_layers=false", "weight_dtype=bfloat16"], ["num_experts=4"]])
def test_init_is_bit_identical_to_a_plain_jit(tmp_path, overrides):
  """state.init_state compiles with INIT_COMPILER_OPTIONS: the values and shardings of jit's defaults, to the
  last bit but for a few ulp (relative 3e-7) in some of the MoE router's values on jax 0.12."""
  c = cfg(tmp_path, "init", *overrides)
  mesh = sharding.create_mesh(c)
  tx = optimizers.build(c).tx
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    got = state_lib.init_state(c, tx, spec)

    def init():
      params = state_lib._model_params(c, c.init_weights_seed, spec.plan)
      return state_lib.TrainState(step=jax.numpy.zeros((), "int32"), params=params, opt_state=tx.init(params))

    want = jax.jit(init, out_shardings=spec.shardings)()
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.sharding == w.sharding and g.dtype == w.dtype
    if jax.numpy.issubdtype(g.dtype, jax.numpy.floating):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-6, atol=0)
    else:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_loop_dispatches_the_next_step_before_reading_this_one(tmp_path, monkeypatch):
  events, step_of = [], {}  # step_of: id of a step's metrics dict -> its step
  real_jit, real_get = steps.jit_train_step, jax.device_get

  def recording(*args):
    step_fn = real_jit(*args)

    def wrapped(state, batch, rng):
      state, metrics = step_fn(state, batch, rng)
      step_of[id(metrics)] = len(step_of)
      events.append(("dispatch", step_of[id(metrics)]))
      return state, metrics

    return wrapped

  def device_get(x):
    if id(x) in step_of:
      events.append(("read", step_of[id(x)]))
    return real_get(x)

  monkeypatch.setattr(steps, "jit_train_step", recording)
  monkeypatch.setattr(jax, "device_get", device_get)
  c = cfg(tmp_path, "order", "steps=5", "per_device_batch_size=1")
  train.run(c)
  assert [e for e in events if e[0] == "read"] == [("read", n) for n in range(5)]
  for n in range(4):  # step n+1 is on its way before the host waits for step n
    assert events.index(("dispatch", n + 1)) < events.index(("read", n))
  assert events[-1] == ("read", 4)  # the last step is read at the end
  assert len(losses(c)) == 5


def test_checkpoint_holds_the_data_state_after_exactly_its_steps(tmp_path, monkeypatch):
  after = []  # after[k]: the train iterator's state once k batches were taken
  saved = {}  # checkpoint step -> the data state saved with it
  real_make, real_save = data_lib.make_iterators, checkpointing.save

  class Counting:
    def __init__(self, inner):
      self.inner = inner
      after.append(inner.get_state())

    def __iter__(self):
      return self

    def __next__(self):
      batch = next(self.inner)
      after.append(self.inner.get_state())
      return batch

    def get_state(self):
      return self.inner.get_state()

    def set_state(self, state):
      self.inner.set_state(state)

  def make_iterators(config, mesh):
    its = real_make(config, mesh)
    return its._replace(train=Counting(its.train))

  def save(manager, step, state, data_state, metadata=None):
    saved[step] = data_state
    real_save(manager, step, state, data_state, metadata)

  monkeypatch.setattr(data_lib, "make_iterators", make_iterators)
  monkeypatch.setattr(checkpointing, "save", save)
  common = ["per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false"]
  train.run(cfg(tmp_path, "data_state", "steps=5", *common))
  assert sorted(saved) == [2, 4, 5]
  assert len(after) == 6  # the initial state and one per step: nothing fetched past the last step
  assert len({str(a) for a in after}) == 6  # each batch moves the iterator on
  for step, state in saved.items():
    assert state == after[step]


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["ici_fsdp_parallelism=4", "ici_data_parallelism=4"], "= 16 != 8 devices per slice"),
    (["per_device_batch_size=0.3"], "not a positive whole global batch"),
    (["hardware=tpu"], "hardware=tpu"),
  ],
)
def test_bad_setups_fail_before_compiling(tmp_path, overrides, message, monkeypatch):
  def no_compile(*args, **kwargs):
    raise AssertionError("reached compilation")

  monkeypatch.setattr(steps, "jit_train_step", no_compile)
  with pytest.raises(ConfigError, match=message):
    train.run(cfg(tmp_path, "bad", "steps=2", *overrides))


def _command(tmp_path, *overrides):
  return [
    sys.executable,
    "MaxText/train.py",
    BASE,
    "run_name=k",
    f"base_output_directory={tmp_path}",
    *TINY,
    *overrides,
  ]


@pytest.mark.quick
def test_typo_in_key_exits_nonzero_naming_the_key(tmp_path):
  result = subprocess.run(_command(tmp_path, "ici_fsdp_parallelizm=2"), cwd=ROOT, capture_output=True, text=True)
  assert result.returncode != 0
  assert "ici_fsdp_parallelism" in result.stderr


@pytest.mark.slow  # 19 s alone (2026-11-28; 60 s in the suite at steps=400: the resumed run saved 38 times)
def test_killed_run_resumes_from_last_checkpoint(tmp_path):
  args = ["steps=100", "per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=10"]
  args += ["async_checkpointing=false", "log_period=50"]
  ckpt = os.path.join(tmp_path, "k", "checkpoints")
  proc = subprocess.Popen(_command(tmp_path, *args), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(ckpt) and any(d.isdigit() and int(d) >= 20 for d in os.listdir(ckpt)):
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  saved = max(int(d) for d in os.listdir(ckpt) if d.isdigit())
  assert 20 <= saved < 100, "the run must be killed mid-way"
  result = subprocess.run(_command(tmp_path, *args), cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"resume from step {saved}" in result.stdout
  assert max(int(d) for d in os.listdir(ckpt) if d.isdigit()) == 100
