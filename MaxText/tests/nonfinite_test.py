"""Non-finite updates and loss spikes: the train step never applies a non-finite update, a run that hits
one stops naming the checkpoint a rerun resumes from, nothing non-finite is ever saved, and the advised
rerun with a lower learning rate works. Spike skipping (skip_step_on_spikes) and the skipped-step count."""

import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from MaxText import checkpointing, metrics, nonfinite, optimizers, sharding, train
from MaxText import data as data_lib
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.tests.conftest import BASE, TINY, cfg, losses


def test_nonfinite_update_is_not_applied_and_counts_as_skipped(tmp_path):
  # The learning rate lives in the optimizer state, so one compiled step can take a finite and an
  # infinite rate: the infinite one makes the new parameters non-finite while loss and grads are finite,
  # the case a loss-only check sees one step late. Wrapped in skip_spikes to check loss/grad_norm reach it.
  c = cfg(tmp_path, "u", "per_device_batch_size=1", "skip_step_on_spikes=true", "skip_step_interval=4")
  tx = optimizers.skip_spikes(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), 4, 6.0)
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    state = state_lib.init_state(c, tx, spec)
    step_fn = steps.jit_train_step(c, mesh, tx, spec, optax.constant_schedule(0.1))
    batch = next(data_lib.make_iterators(c, mesh).train)
    state, good = step_fn(state, batch, jax.random.key(0))
    before = jax.device_get(state.params)
    inner = state.opt_state.inner
    inner.hyperparams["learning_rate"] = jnp.full_like(inner.hyperparams["learning_rate"], jnp.inf)
    state, bad = step_fn(state, batch, jax.random.key(1))
  assert float(good["update_finite"]) == 1 and float(good["step_skipped"]) == 0
  assert float(bad["update_finite"]) == 0 and float(bad["step_skipped"]) == 1
  assert np.isfinite(float(bad["loss"])) and np.isfinite(float(bad["grad_norm"]))
  assert int(state.step) == 2  # the step still advances: data order and checkpoint numbers stay aligned
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
  assert int(state.opt_state.count) == 1  # skip_spikes' history did not take the reverted step either


def test_the_finite_check_is_computed_once_not_fused_into_every_leaf_s_update(tmp_path):
  """The update's finite flag is an and over every leaf. Fused into each leaf's select, it made the
  compiled step grow with the square of the leaf count (tiny gemma3: 82K `and`s, 3x its compile time)."""
  c = cfg(tmp_path, "f", "scan_layers=false", "base_num_decoder_layers=4", "per_device_batch_size=1")
  tx, schedule = optimizers.build(c)
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    batch = next(data_lib.make_iterators(c, mesh).train)
    text = steps.jit_train_step(c, mesh, tx, spec, schedule).lower(spec.abstract, batch, jax.random.key(0))
    text = text.compile().as_text()
  leaves = len(jax.tree.leaves((spec.abstract.params, spec.abstract.opt_state)))
  assert leaves > 100
  assert len(re.findall(r" and\(", text)) < 4 * leaves  # was about leaves squared


def test_skip_spikes_skips_a_jump_and_keeps_the_inner_state():
  tx = optimizers.skip_spikes(optax.sgd(1.0), interval=4, factor=3.0)
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  grads = {"w": jnp.ones(3)}
  for loss in (1.0, 1.1, 0.9, 1.0):
    updates, state = tx.update(grads, state, params, loss=jnp.float32(loss), grad_norm=jnp.float32(1.0))
    assert not bool(state.skipped)
  np.testing.assert_array_equal(updates["w"], -np.ones(3))
  updates, state = tx.update(grads, state, params, loss=jnp.float32(50.0), grad_norm=jnp.float32(1.0))
  assert bool(state.skipped) and not np.any(updates["w"])
  updates, state = tx.update(grads, state, params, loss=jnp.float32(1.0), grad_norm=jnp.float32(80.0))
  assert bool(state.skipped)  # a grad-norm spike alone is enough
  updates, state = tx.update(grads, state, params, loss=jnp.float32(1.0), grad_norm=jnp.float32(1.0))
  assert not bool(state.skipped) and int(state.count) == 7


def test_logger_counts_skipped_steps(tmp_path, capsys):
  c = cfg(tmp_path, "m", "steps=4")
  kwargs = {"num_devices": 1, "tokens_per_step": 8, "flops_per_step": 1.0, "peak_flops_per_device": 1.0}
  with metrics.MetricLogger(c, start_step=0, is_writer=True, **kwargs) as logger:
    for step, skipped in enumerate((0.0, 1.0, 0.0, 1.0)):
      logger.log(step, {"loss": 1.0, "update_finite": 1 - skipped, "step_skipped": skipped}, 0.1)
    summary = logger.summary()
  assert summary["skipped_steps"] == 2
  out = capsys.readouterr().out
  assert "update_finite" not in out and "skipped_steps 2" in out and "skipped steps        2" in out


def _all_finite(path):
  tree = checkpointing.saved_tree(path)
  arrays = ocp.PyTreeCheckpointer().restore(
    path,
    args=ocp.args.PyTreeRestore(restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)),
  )
  return all(np.isfinite(x).all() for x in jax.tree.leaves(arrays) if np.issubdtype(np.asarray(x).dtype, np.inexact))


@pytest.mark.slow
def test_huge_learning_rate_stops_saves_nothing_nonfinite_and_lower_rate_reruns(tmp_path):
  # learning_rate=1e6: the step-1 update gives finite but enormous parameters whose step-2 loss is NaN.
  common = ["per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=1", "steps=4"]
  common += ["async_checkpointing=false", "learning_rate_schedule_steps=4"]
  expected = r"step 3 .*last good checkpoint, step 1 .*checkpoint 2 itself"
  with pytest.raises(nonfinite.NonFiniteLossError, match=expected):
    train.run(cfg(tmp_path, "lr", "learning_rate=1e6", *common))
  c = cfg(tmp_path, "lr", "learning_rate=1e-4", *common)
  for step in os.listdir(c.checkpoint_dir):
    assert _all_finite(os.path.join(c.checkpoint_dir, step, "state")), step
  summary = train.run(c)  # the advised rerun: resumes from step 1, not from the checkpoint that gives NaN
  assert summary["steps_run"] == 3 and summary["skipped_steps"] == 0
  assert os.listdir(os.path.join(c.run_dir, checkpointing.NONFINITE_DIR)) == ["2"]
  assert all(np.isfinite(x) for x in losses(c)[-3:])


RESUME = ["per_device_batch_size=1", "enable_checkpointing=true", "checkpoint_period=2", "async_checkpointing=false"]


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
  """A run directory with checkpoints 2 and 4."""
  root = tmp_path_factory.mktemp("resumable")
  train.run(cfg(root, "r", *RESUME, "steps=4"))
  return root


def _rewrite_step_4(c, change):
  """Replace checkpoint 4 by change(its state), saved with checksums that match: an intact but bad state."""
  tx = optimizers.build(c).tx
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    manager = checkpointing.create_manager(c)
    restored = checkpointing.restore_or_init(c, tx, spec, manager)
    shutil.rmtree(os.path.join(c.checkpoint_dir, "4"))
    manager.reload()
    state = restored.state.replace(**change(restored.state))
    checkpointing.save(manager, 4, state, restored.data_state)
    checkpointing.finish(manager)


def _huge_moments(state):
  # Adam's first moment near float32's largest value with a zero second moment: the next update is infinite
  # while the loss (the params are unchanged) stays finite.
  def huge(path, x):
    name = jax.tree_util.keystr(path)
    return jnp.full_like(x, 3e38) if ".mu" in name and jnp.issubdtype(x.dtype, jnp.floating) else x

  def zero(path, x):
    name = jax.tree_util.keystr(path)
    return jnp.zeros_like(x) if ".nu" in name and jnp.issubdtype(x.dtype, jnp.floating) else x

  opt_state = jax.tree_util.tree_map_with_path(huge, state.opt_state)
  return {"opt_state": jax.tree_util.tree_map_with_path(zero, opt_state)}


def _resumed(resumable, tmp_path, change):
  shutil.copytree(resumable / "r", tmp_path / "r")
  c = cfg(tmp_path, "r", *RESUME, "steps=6")
  _rewrite_step_4(c, change)
  return c


def test_an_intact_checkpoint_whose_first_update_is_not_finite_is_not_advised_as_is(resumable, tmp_path):
  c = _resumed(resumable, tmp_path, _huge_moments)
  with pytest.raises(nonfinite.NonFiniteLossError) as e:
    train.run(c)
  message = str(e.value)
  assert message.startswith("the update is not finite at step 5") and "\n" not in message
  assert "Checkpoint step 4, which this run resumed from, was read again and matches its checksums" in message
  assert "last good checkpoint, step 4" not in message  # the state that just failed is never advised as is
  assert f"move {c.checkpoint_dir}/4 to {c.run_dir}/checkpoints_nonfinite/4 and rerun, which resumes from step 2" in (
    message
  )
  assert "lower learning_rate" in message
  assert sorted(os.listdir(c.checkpoint_dir)) == ["2", "4"]  # moving it is the user's choice


@pytest.mark.slow
def test_an_intact_checkpoint_whose_own_loss_is_not_finite_is_set_aside_by_the_rerun(resumable, tmp_path):
  # A NaN in the saved params, with checksums that match it: the loss of the first step is NaN at any learning rate.
  c = _resumed(resumable, tmp_path, lambda s: {"params": jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), s.params)})
  with pytest.raises(nonfinite.NonFiniteLossError, match=r"last good checkpoint, step 2 .*checkpoint 4 itself"):
    train.run(c)


def test_a_checkpoint_damaged_after_the_resume_is_moved_aside_and_the_advice_names_the_step_before(
  resumable, tmp_path, monkeypatch, capsys
):
  # The files of step 4 go bad after it was restored and verified (failing storage): read again, it no longer
  # matches its checksums, so the learning rate is not blamed.
  c = _resumed(resumable, tmp_path, _huge_moments)
  real = checkpointing.restore_or_init

  def restore_then_damage(*args):
    restored = real(*args)
    for dirpath, _, names in os.walk(os.path.join(c.checkpoint_dir, "4", "state")):
      for name in names if os.path.basename(dirpath) == "d" else ():
        with open(os.path.join(dirpath, name), "r+b") as f:
          data = bytearray(f.read())
          for i in range(0, len(data), 64):
            data[i] ^= 0x10
          f.seek(0)
          f.write(data)
    return restored

  monkeypatch.setattr(checkpointing, "restore_or_init", restore_then_damage)
  with pytest.raises(nonfinite.NonFiniteLossError) as e:
    train.run(c)
  message = str(e.value)
  assert "The state it came from is damaged: checkpoint step 4, which this run resumed from, is damaged" in message
  assert "A rerun resumes from the last good checkpoint, step 2" in message and "learning_rate" not in message
  assert sorted(os.listdir(c.checkpoint_dir)) == ["2"]
  assert os.listdir(os.path.join(c.run_dir, checkpointing.UNREADABLE_DIR)) == ["4"]
  assert f"moved it to {c.run_dir}/checkpoints_unreadable/4" in capsys.readouterr().out


def test_check_skipped_refuses_a_run_whose_updates_were_mostly_skipped():
  nonfinite.check_skipped({"steps_run": 4, "skipped_steps": 2})  # half is not most
  nonfinite.check_skipped({"steps_run": 0})  # already done: nothing ran
  with pytest.raises(nonfinite.SkippedUpdatesError, match=r"^3 of the 4 updates of this run were skipped") as e:
    nonfinite.check_skipped({"steps_run": 4, "skipped_steps": 3})
  assert "\n" not in str(e.value) and "lower learning_rate" in str(e.value).lower()
  summary = {"steps_run": 4, "skipped_steps": 3, "mfu": None, "compile_steps_time_s": 1.0, "total_time_s": 2.0}
  line = metrics.format_summary(summary | dict.fromkeys(SUMMARY_KEYS))
  assert "skipped steps        3 (not applied: non-finite or a loss spike; more than half" in line


SUMMARY_KEYS = ("final_loss", "mean_step_time_s", "tokens_per_s_per_device", "tflops_per_s_per_device")


def test_a_run_without_nan_check_that_skipped_most_updates_exits_1(tmp_path, capsys):
  # learning_rate=1e6: the first updates make the params enormous, every later update is not finite and skipped.
  argv = ["train.py", BASE, "run_name=s", f"base_output_directory={tmp_path}", *TINY, "per_device_batch_size=1"]
  with pytest.raises(SystemExit) as e:
    train.main([*argv, "steps=8", "nan_check=false", "learning_rate=1e6", "learning_rate_schedule_steps=8"])
  assert re.match(r"SkippedUpdatesError: [5-8] of the 8 updates of this run were skipped", str(e.value.code))
  assert re.search(r"skipped steps        [5-8] \(not applied: .*; more than half", capsys.readouterr().out)
