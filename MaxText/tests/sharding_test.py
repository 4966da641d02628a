"""Mesh construction from ici_*/dcn_* keys, batch checks and logical -> mesh mapping."""

import os

import jax
import pytest
from jax.sharding import PartitionSpec

from MaxText import config, planner, sharding
from MaxText.errors import ConfigError
from MaxText.tests.helpers import built

pytestmark = pytest.mark.quick  # the whole module is in the quick tier

BASE = os.path.join(config.CONFIG_DIR, "base.yml")


def load(*overrides):
  return config.load([BASE, "run_name=t", *overrides], {})


def test_minus_one_is_filled():
  mesh = sharding.create_mesh(load("ici_fsdp_parallelism=-1", "ici_tensor_parallelism=2"))
  assert mesh.shape["fsdp"] == 4 and mesh.shape["tensor"] == 2 and mesh.size == 8
  assert tuple(mesh.axis_names) == (
    "data",
    "stage",
    "fsdp",
    "fsdp_transpose",
    "sequence",
    "context",
    "tensor",
    "expert",
    "autoregressive",
  )


def test_impossible_mesh_names_the_product():
  with pytest.raises(ConfigError, match=r"ici_fsdp_parallelism\(4\) \* ici_tensor_parallelism\(4\) = 16 != 8"):
    sharding.create_mesh(load("ici_fsdp_parallelism=4", "ici_tensor_parallelism=4"))
  with pytest.raises(ConfigError, match="does not divide"):
    sharding.create_mesh(load("ici_fsdp_parallelism=-1", "ici_tensor_parallelism=3"))
  with pytest.raises(ConfigError, match="At most one"):
    sharding.create_mesh(load("ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"))


def test_one_device_mesh():
  mesh = sharding.create_mesh(load(), jax.devices()[:1])
  assert mesh.size == 1


def test_global_batch_checks():
  mesh = sharding.create_mesh(load())
  assert sharding.global_batch_size(load("per_device_batch_size=2"), mesh) == 16
  tp_mesh = sharding.create_mesh(load("ici_tensor_parallelism=2"))  # batch over the 4 fsdp devices
  assert sharding.global_batch_size(load("per_device_batch_size=0.5"), tp_mesh) == 4
  with pytest.raises(ConfigError, match="not a positive whole global batch"):
    sharding.global_batch_size(load("per_device_batch_size=0.3"), mesh)
  with pytest.raises(ConfigError, match="does not split over the 8 devices"):
    sharding.global_batch_size(load("per_device_batch_size=0.25"), mesh)
  with pytest.raises(ConfigError, match="gradient_accumulation_steps=3"):
    sharding.global_batch_size(load("per_device_batch_size=1", "gradient_accumulation_steps=3"), mesh)


def test_logical_rules_map_to_mesh_axes():
  c = load("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  mesh = sharding.create_mesh(c)
  rules = sharding.axis_rules(c)
  got = sharding.logical_to_mesh({"w": PartitionSpec("embed", "mlp"), "n": PartitionSpec("norm")}, mesh, rules)
  # mlp takes fsdp_transpose first, so embed falls back to its second rule.
  assert got["w"].spec == PartitionSpec(
    ("fsdp", "sequence", "context", "expert"), ("fsdp_transpose", "tensor", "autoregressive")
  )
  assert got["n"].spec == PartitionSpec(None)
  assert sharding.input_sharding(c, mesh).spec == PartitionSpec(
    ("data", "stage", "fsdp", "fsdp_transpose", "expert"), None
  )


@pytest.mark.parametrize(
  "mesh_args",
  [
    ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
    ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
    ["ici_tensor_parallelism=2", "ici_data_parallelism=4", "ici_fsdp_parallelism=1"],
  ],
)
def test_forward_is_sharding_invariant(mesh_args):
  """Logits of a sharded forward pass equal the unsharded ones (guards the logical_axis_rules)."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  tiny = ["base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=48", "head_dim=8"]
  tiny += ["base_num_decoder_layers=1", "vocab_size=320", "dtype=float32"]
  c = load(*tiny, *mesh_args)
  mesh = sharding.create_mesh(c)
  graphdef, params = nnx.split(built(c, planner.build(c, mesh)), nnx.Param)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 300, (4, 16)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(16), (4, 16))
  segments = jnp.ones((4, 16), jnp.int32)
  forward = lambda p, t, q, s: nnx.merge(graphdef, p)(t, q, s)  # noqa: E731
  expected = jax.jit(forward)(params, tokens, positions, segments)  # on one device
  with sharding.activate(c, mesh):
    shardings = sharding.logical_to_mesh(nnx.get_partition_spec(params), mesh, sharding.axis_rules(c))
    placed = jax.device_put(params, shardings)
    got = jax.jit(forward)(placed, tokens, positions, segments)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
