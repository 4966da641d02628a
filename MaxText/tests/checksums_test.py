"""checksums.py: per-array digests that catch any single flipped bit, equal on any mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import checksums

DTYPES = [jnp.bfloat16, jnp.float32, jnp.int8, jnp.int32, jnp.uint16]


def tree_of(x):
  return {"w": x, "nested": {"i": jnp.arange(10, dtype=jnp.int32), "key": jax.random.key(3)}, "s": jnp.float32(2.0)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_is_detected(dtype):
  x = (jax.random.normal(jax.random.key(0), (8, 6)) * 50).astype(dtype)
  expected = checksums.digests(tree_of(x))
  raw = np.asarray(x).view(f"u{x.dtype.itemsize}")
  for index in range(raw.size):
    for bit in range(8 * x.dtype.itemsize):
      damaged = raw.copy()
      damaged.flat[index] ^= damaged.dtype.type(1 << bit)
      y = jnp.asarray(damaged.view(x.dtype))
      assert checksums.mismatches(expected, tree_of(y)) == ["w"], (index, bit)


def test_same_digest_on_any_sharding():
  x = jax.random.normal(jax.random.key(1), (16, 24), jnp.float32)
  expected = checksums.digests(tree_of(x))
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  for spec in (PartitionSpec("a", "b"), PartitionSpec("b", None), PartitionSpec(None, ("a", "b"))):
    assert checksums.digests(tree_of(jax.device_put(x, NamedSharding(mesh, spec)))) == expected


def test_names_and_prefix():
  names = checksums.digests(tree_of(jnp.ones((2,))), prefix="state/")
  assert sorted(names) == ["state/nested/i", "state/nested/key", "state/s", "state/w"]
  assert all(len(v) == 16 for v in names.values())
  assert checksums.mismatches({"w": "0" * 16}, {"w": jnp.ones((2,)), "x": jnp.zeros((1,))}) == ["w"]
