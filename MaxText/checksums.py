"""Per-array digests of a checkpoint, computed on the devices that hold the shards (docs/checkpoints.md).

Orbax's TensorStore arrays carry no checksum over their data chunks (its zarr3 layout checksums only the shard
index), so a flipped bit in a data file restores silently. A checkpoint therefore records, next to the arrays, a
64-bit digest of each array's bytes: two sums over the array's words w_i (its raw bits as unsigned integers,
i the element's position in the whole array), each mod 2^32:

    a = sum_i w_i * (2i + 1)            b = sum_i (w_i XOR 0x5bd1e995) * ((2i + 1) * 0x9e3779b1)

Every weight is odd, so changing any one bit of any one word changes both sums: a single flipped bit is always
detected; more damage goes unnoticed only by a 1 in 2^64 chance. The sums run where the shards live (one pass
over the state, no host copy) and add up across devices exactly, in any order, so a restored array on another
mesh gives the same digest. The step's `data` item (the iterator state, JSON) is recorded too, as a sha256 of its
canonical text under DATA_KEY.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import paths
from MaxText.errors import CheckpointError

DATA_KEY = "data"  # the table's entry for the step's `data` item (the iterator state); no state leaf has this name
_MIX = np.uint32(0x5BD1E995)
_GOLDEN = np.uint32(0x9E3779B1)


def _words(x: jax.Array) -> jax.Array:
  """The array's raw bits as uint32 words, same shape (8-byte items: a trailing axis of 2 words)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _digest(x: jax.Array) -> jax.Array:
  """uint32 [2]: the two sums of the module docstring."""
  w = _words(x)
  index = jnp.zeros(w.shape, jnp.uint32)
  for axis in range(w.ndim):  # the element's position in row-major order, wrapping mod 2^32 as the sums do
    stride = np.uint32(int(np.prod(w.shape[axis + 1 :], dtype=np.uint64)) % 2**32)
    index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * stride
  weight = index * np.uint32(2) + np.uint32(1)
  return jnp.stack([jnp.sum(w * weight, dtype=jnp.uint32), jnp.sum((w ^ _MIX) * (weight * _GOLDEN), dtype=jnp.uint32)])


@functools.partial(jax.jit)
def _digests(tree: Any) -> Any:
  return jax.tree.map(_digest, tree)


def lowered(tree: Any) -> Any:
  """The digest program of `tree`'s arrays (or their jax.ShapeDtypeStruct, with shardings), lowered, not run:
  train_compile.py reports what it adds per device."""
  return _digests.lower([x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array | jax.ShapeDtypeStruct)])


def key(path: Any) -> str:
  """A leaf's name in the digest table: its tree path joined with '/' (the same for a state and its params)."""
  parts = []
  for entry in path:
    name = getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))
    parts.append(str(name))
  return "/".join(parts)


def digests(tree: Any, prefix: str = "") -> dict[str, str]:
  """{leaf name: 16 hex digits} for every array leaf of `tree` (None and non-array leaves are skipped)."""
  leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree) if isinstance(x, jax.Array | np.ndarray)]
  if not leaves:
    return {}
  sums = jax.device_get(_digests([jnp.asarray(x) if isinstance(x, np.ndarray) else x for _, x in leaves]))
  return {prefix + key(p): f"{int(s[0]):08x}{int(s[1]):08x}" for (p, _), s in zip(leaves, sums, strict=True)}


def mismatches(expected: dict[str, str], tree: Any, prefix: str = "") -> list[str]:
  """The names of `tree`'s arrays whose digest differs from `expected` (arrays `expected` lacks are not checked)."""
  actual = digests(tree, prefix)
  return sorted(name for name, value in actual.items() if name in expected and expected[name] != value)


def saved(step_dir: str) -> dict[str, str] | None:
  """The digest table saved with the checkpoint step at `step_dir` (its `checksums` item), or None for a step
  written without one (before this module existed)."""
  path = paths.join(step_dir, "checksums", "metadata")
  return json.loads(paths.Path(path).read_text()) if paths.isfile(path) else None


def verify(step_dir: str, tree: Any, what: str, prefix: str = "") -> None:
  """CheckpointError naming the first array of `tree` (restored from the step at `step_dir`; `prefix`: its path in
  the saved state, e.g. "params/") whose digest differs from the one saved with it. A step without digests is
  restored unverified, and `what` (the step, as messages name it) says so in one line."""
  table = saved(step_dir)
  if table is None:
    if jax.process_index() == 0:
      print(f"{what} carries no checksums (written before they were recorded): restored unverified", flush=True)
    return
  bad = mismatches(table, tree, prefix)
  if bad:
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise CheckpointError(f"{what}: array {bad[0]}{more} does not match the checksum saved with it (damaged data)")


def json_digest(value: Any) -> str:
  """16 hex digits of a JSON value (sha256 of its canonical text, as a JSON round trip leaves it)."""
  text = json.dumps(json.loads(json.dumps(value)), sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def verify_json(step_dir: str, value: Any, what: str) -> None:
  """CheckpointError when the iterator state restored from the step at `step_dir` is not the one saved with it
  (a step without a digest of it is not checked)."""
  expected = (saved(step_dir) or {}).get(DATA_KEY)
  if expected is not None and json_digest(value) != expected:
    raise CheckpointError(f"{what}: the data iterator state does not match the checksum saved with it (damaged)")
