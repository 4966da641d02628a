"""attention=flash: the splash kernels (Pallas interpreter on CPU) equal dot_product_attention forward and
backward, sharded or not; and they lower to a Mosaic custom call when compiled for a TPU topology."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import config, planner, sharding
from MaxText.layers import attention_kernels
from MaxText.layers.attention import attention_mask, dot_product_attention
from MaxText.parallel import ops

BASE = os.path.join(config.CONFIG_DIR, "base.yml")


def inputs(b=2, t=384, n=4, k=2, h=64, packed=True, seed=0):
  """Scaled q [B, T, N, H], k/v [B, T, K, H], segment ids [B, T] with 3 documents per row when packed."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h)) * h**-0.5
  kv = [jax.random.normal(key, (b, t, k, h)) for key in keys[1:3]]
  # Row-dependent boundaries; the trailing 0s are padding, which attends within itself as in the model.
  starts = np.resize([[0, 70, 190, t - 16], [0, 30, 100, t]], (b, 4)) if packed else np.array([[0, t, t, t]] * b)
  segments = (np.arange(t)[None, :, None] >= starts[:, None, :3]).sum(-1) % 4
  segments = np.where(np.arange(t)[None] >= starts[:, 3:], 0, segments)
  return q, kv[0], kv[1], jnp.asarray(segments, jnp.int32), keys[3]


def reference(q, k, v, segment_ids, sliding_window=0, logits_soft_cap=0.0, chunk_window=0):
  mask = attention_mask(segment_ids, sliding_window, chunk_window=chunk_window)
  return dot_product_attention(q, k, v, mask, logits_soft_cap)


def flash(q, k, v, segment_ids, sliding_window=0, logits_soft_cap=0.0, chunk_window=0, plan=None):
  return attention_kernels.flash_attention(
    q, k, v, segment_ids, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, interpret=True,
    chunk_window=chunk_window, plan=plan,
  )  # fmt: skip


def value_and_grads(fn, q, k, v, segment_ids, cotangent, **options):
  """Output, and d<out, cotangent>/d(q, k, v): one random direction checks the whole vjp."""
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, segment_ids, **options) * cotangent)  # noqa: E731
  both = lambda q, k, v: (fn(q, k, v, segment_ids, **options), jax.grad(loss, (0, 1, 2))(q, k, v))  # noqa: E731
  return jax.jit(both)(q, k, v)  # one compile; op by op, each small op compiles alone


def assert_close(got, want, tol=1e-4):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.parametrize(
  "shape, packed, options",
  [
    # T=384 runs 3 blocks of 128: skipped, partial and full mask blocks.
    (dict(k=4), False, {}),  # plain causal, one head per kv head
    (dict(k=4), True, {}),  # packed documents and padding
    (dict(k=2), True, dict(sliding_window=100)),  # local window, not a multiple of the block
    (dict(k=2), True, dict(chunk_window=160)),  # llama4's chunks, not a multiple of the block
    (dict(k=2, t=128, h=128), True, {}),  # GQA N=4, K=2; one block
    (dict(k=1), True, dict(logits_soft_cap=2.0)),  # MQA with soft cap (small cap: tanh far from linear)
  ],
  ids=["causal", "packed", "window", "chunk", "gqa", "softcap_mqa"],
)
def test_flash_equals_dot_product_forward_and_backward(shape, packed, options):
  q, k, v, segment_ids, key = inputs(packed=packed, **shape)
  cotangent = jax.random.normal(key, q.shape)
  got = value_and_grads(flash, q, k, v, segment_ids, cotangent, **options)
  want = value_and_grads(reference, q, k, v, segment_ids, cotangent, **options)
  assert_close(got, want)


def test_length_not_a_multiple_of_128_says_what_to_change():
  q, k, v, segment_ids, _ = inputs(t=200, packed=False)
  with pytest.raises(ValueError, match=r"multiple of 128; got 200.*max_target_length.*256"):
    flash(q, k, v, segment_ids)
  with pytest.raises(ValueError, match="N a multiple of K"):
    flash(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), segment_ids)


def mesh_config(*overrides):
  return config.load([BASE, "run_name=t", *overrides], {})


@pytest.mark.parametrize(
  "mesh_args, kv_heads, repeat_kv",
  [
    (["ici_fsdp_parallelism=-1"], 2, False),  # batch only, over data x fsdp
    (["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], 2, False),
    (["ici_fsdp_parallelism=2", "ici_tensor_parallelism=4"], 1, True),  # 1 kv head over 4 tensor shards
    (["ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2"], 2, False),  # T gathered
  ],
  ids=["fsdp8", "data2_fsdp2_tensor2", "mqa_tensor4", "sequence2"],
)
def test_sharded_equals_unsharded(mesh_args, kv_heads, repeat_kv):
  """Under the run plan of the mesh and the base.yml rules the kernel runs per shard (shard_map) and gives the
  same values."""
  c = mesh_config(*mesh_args)
  mesh = sharding.create_mesh(c)
  plan = planner.build(c, mesh)
  q, k, v, segment_ids, key = inputs(b=8, t=128, k=kv_heads, h=128)
  cotangent = jax.random.normal(key, q.shape)
  want = value_and_grads(reference, q, k, v, segment_ids, cotangent, sliding_window=64)
  with sharding.activate(c, mesh):
    run = jax.jit(lambda *a: value_and_grads(flash, *a, sliding_window=64, plan=plan))
    got = run(q, k, v, segment_ids, cotangent)
  split = ops.head_split(plan, q.shape, k.shape)
  assert split.repeat_kv == repeat_kv
  assert split.q[0] is not None  # the batch is split
  assert (split.q[2] is not None) == (mesh.shape["tensor"] > 1)
  assert_close(got, want)


def tpu_devices(grid: str) -> list:
  """The devices of a v5e topology description from libtpu (no TPU needed)."""
  pytest.importorskip("libtpu", reason="compiling for TPU topologies needs libtpu (requirements-tpu.txt)")
  from jax.experimental import topologies

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    desc = topologies.get_topology_desc(topology_name=f"v5e:{grid}", platform="tpu")
  except Exception as e:  # the plugin raises different types when it cannot load
    pytest.skip(f"libtpu cannot describe v5e:{grid}: {e}")
  return list(desc.devices)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiles_to_a_mosaic_kernel_for_tpu(head_dim):
  """Forward and backward jitted for a v5e 2x2 slice (data 2 x tensor 2): each lowers to TPU custom calls (the
  Pallas kernels), run per shard as the run plan says."""
  c = mesh_config("ici_data_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1")
  mesh = sharding.create_mesh(c, tpu_devices("2x2"))
  plan = planner.build(c, mesh)
  assert plan.platform == "tpu" and not plan.attention.interpret
  q = jax.ShapeDtypeStruct((4, 1024, 8, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((4, 1024, 2, head_dim), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((4, 1024), jnp.int32)

  def step(q, k, v, segment_ids):
    loss = lambda q, k, v: jnp.sum(  # noqa: E731
      attention_kernels.flash_attention(q, k, v, segment_ids, sliding_window=256, logits_soft_cap=30.0, plan=plan)
    )
    return jax.grad(loss, (0, 1, 2))(q, k, v)

  with sharding.activate(c, mesh):
    compiled = jax.jit(step).lower(q, kv, kv, ids).compile()
  text = compiled.as_text()
  assert text.count("tpu_custom_call") >= 3, "forward, dq and dkv kernels"
