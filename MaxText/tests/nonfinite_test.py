"""Non-finite updates and loss spikes: the train step never applies a non-finite update, a run that hits
one stops naming the checkpoint a rerun resumes from, nothing non-finite is ever saved, and the advised
rerun with a lower learning rate works. Spike skipping (skip_step_on_spikes) and the skipped-step count."""

import os

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
from MaxText.tests.conftest import cfg, losses


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
