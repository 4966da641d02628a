"""Mesh construction from ici_*/dcn_* keys, batch checks and logical -> mesh mapping."""

import os

import jax
import pytest
from jax.sharding import PartitionSpec

from MaxText import config, sharding
from MaxText.config import ConfigError

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
  assert got["w"].spec == PartitionSpec(("fsdp", "sequence", "expert"), ("fsdp_transpose", "tensor", "autoregressive"))
  assert got["n"].spec == PartitionSpec(None)
  assert sharding.input_sharding(c, mesh).spec == PartitionSpec(
    ("data", "stage", "fsdp", "fsdp_transpose", "expert"), None
  )
