"""Training attention: the kernel choice per platform and the query-chunked dot product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import config as config_lib
from MaxText import planner, sharding
from MaxText.errors import ConfigError
from MaxText.layers import attention, kv_cache

pytestmark = pytest.mark.quick  # the whole module is in the quick tier


def config(*overrides):
  return config_lib.load(["MaxText/configs/base.yml", "run_name=t", *overrides])


def inputs(b=2, t=256, n=4, k=2, h=32, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32) * h**-0.5
  kv = [jax.random.normal(key, (b, t, k, h), jnp.float32) for key in keys[1:]]
  segments = jnp.concatenate([jnp.ones((b, t // 2), jnp.int32), 2 * jnp.ones((b, t // 2 - 8), jnp.int32)], axis=1)
  segments = jnp.pad(segments, ((0, 0), (0, 8)))  # a packed batch with padding at the end
  return q, *kv, segments


@pytest.mark.parametrize("window, cap", [(0, 0.0), (48, 0.0), (0, 5.0)])
def test_chunked_dot_product_equals_the_whole_sequence(window, cap):
  q, k, v, segments = inputs()

  def whole(q, k, v):
    return attention.dot_product_attention(q, k, v, attention.attention_mask(segments, window), cap)

  def chunked(q, k, v):
    return attention.chunked_dot_product_attention(q, k, v, segments, window, cap, chunk=64)

  np.testing.assert_allclose(jax.jit(chunked)(q, k, v), jax.jit(whole)(q, k, v), rtol=1e-5, atol=1e-6)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2)))  # noqa: E731
  for got, want in zip(grad(chunked)(q, k, v), grad(whole)(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_attend_chunks_only_when_the_chunk_divides_a_longer_sequence():
  q, k, v, segments = inputs(t=256)
  want = attention.dot_product_attention(q, k, v, attention.attention_mask(segments), 0.0)
  for chunk in (0, 64, 256):
    c = config(f"attention_query_chunk={chunk}", "max_target_length=256", "attention=dot_product")
    np.testing.assert_allclose(attention.attend(planner.build(c), q, k, v, segments), want, rtol=1e-5, atol=1e-6)


def test_attention_query_chunk_must_divide_the_length():
  with pytest.raises(ConfigError, match="attention_query_chunk=300 must be 0"):
    config("attention_query_chunk=300", "max_target_length=2048")


def test_autoselected_follows_the_target_platform():
  c = config("attention=autoselected", "max_target_length=256")
  plan = planner.build(c).attention  # CPU, no mesh
  assert (plan.kernel, plan.platform) == ("dot_product", "cpu") and "no fused kernel on cpu" in plan.reason
  assert planner.build(config("attention=flash", "max_target_length=256")).attention.kernel == "flash"  # explicit wins
  pytest.importorskip("libtpu")
  from jax.experimental import topologies

  try:
    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
  except Exception as e:  # noqa: BLE001 (libtpu present but cannot describe topologies here)
    pytest.skip(f"no TPU topology description: {e}")
  plan = planner.build(c, sharding.create_mesh(c, devices)).attention
  assert (plan.kernel, plan.platform) == ("flash", "tpu") and "TPU" in plan.reason
  assert plan.kernel_for(200) == "dot_product"  # the kernel tiles by 128
  with pytest.raises(ConfigError, match="needs NVIDIA GPUs"):
    planner.build(config("attention=cudnn_flash_te"), sharding.create_mesh(c, devices))


def test_flash_through_attend_equals_dot_product_for_narrower_values():
  # MLA's values are narrower than its queries/keys: attend pads them for the kernel.
  q, k, v, segments = inputs(t=128, h=64)
  v = v[..., :32]
  c = config("attention=flash", "max_target_length=128")
  want = attention.dot_product_attention(q, k, v, attention.attention_mask(segments), 0.0)
  np.testing.assert_allclose(attention.attend(planner.build(c), q, k, v, segments), want, rtol=1e-4, atol=1e-5)


def test_flash_on_a_gpu_points_to_cudnn(monkeypatch):
  monkeypatch.setattr(planner, "target_platform", lambda mesh: "gpu")
  with pytest.raises(ConfigError, match="cudnn_flash_te"):
    planner.build(config("attention=flash", "max_target_length=128"))
  with pytest.raises(ConfigError, match="soft_cap"):
    planner.build(config("attention=cudnn_flash_te", "attn_logits_soft_cap=30"))
  assert planner.build(config("attention=autoselected")).attention.kernel == "cudnn_flash_te"
  assert planner.build(config("attention=autoselected", "attn_logits_soft_cap=30")).attention.kernel == "dot_product"


def test_chunked_mask_keeps_each_query_in_its_own_chunk():
  """chunk_window=4 (llama4): query i sees keys j <= i with i // 4 == j // 4, in training and decode masks."""
  segments = jnp.ones((1, 10), jnp.int32)
  got = np.asarray(attention.attention_mask(segments, chunk_window=4))[0, 0, 0]
  i, j = np.arange(10)[:, None], np.arange(10)[None, :]
  np.testing.assert_array_equal(got, (j <= i) & (i // 4 == j // 4))
  decode = kv_cache.mask(jnp.arange(10)[None], 12, chunk_window=4)[0, 0, 0]
  np.testing.assert_array_equal(np.asarray(decode)[:, :10], got)
