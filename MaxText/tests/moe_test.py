"""MoE layer: dropless ragged_dot equals a dense per-expert reference; capacity dropping; balance loss."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText import config
from MaxText.layers import moe

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
TINY = ["base_emb_dim=16", "base_mlp_dim=24", "num_experts=4", "num_experts_per_tok=2", "dtype=float32"]


def block(*overrides):
  c = config.load([BASE, "run_name=t", *TINY, *overrides], {})
  with nnx.use_eager_sharding(False):
    return moe.MoeBlock(c, rngs=nnx.Rngs(params=0))


def reference(layer, x):
  """Every expert on every token, combined with the renormalised top-k weights."""
  tokens = x.reshape(-1, x.shape[-1])
  routing = moe.route(layer.gate(tokens), layer.config)
  h = jax.nn.silu(jnp.einsum("XD,EDF->XEF", tokens, layer.wi_0[...])) * jnp.einsum(
    "XD,EDF->XEF", tokens, layer.wi_1[...]
  )
  out = jnp.einsum("XEF,EFD->XED", h, layer.wo[...])  # [X, E, D]
  weights = jnp.zeros((tokens.shape[0], layer.num_experts)).at[jnp.arange(tokens.shape[0])[:, None], routing.experts]
  return jnp.einsum("XED,XE->XD", out, weights.set(routing.weights)).reshape(x.shape)


def test_dropless_matches_dense_reference_and_records_balance_loss():
  layer = block()
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  np.testing.assert_allclose(layer(x), reference(layer, x), rtol=1e-5, atol=1e-5)
  assert float(layer.load_balance_loss[...]) > 0.5  # k (= 2) when perfectly balanced


def test_capacity_drops_tokens_beyond_capacity():
  experts = jnp.asarray([[0, 1], [0, 1], [0, 2], [3, 0]])
  keep = moe.capacity_mask(experts, num_experts=4, capacity_factor=1.0)  # capacity = ceil(8 / 4) = 2
  np.testing.assert_array_equal(keep, [[True, True], [True, True], [False, True], [True, False]])
  layer = block("capacity_factor=0.25")
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  assert not np.allclose(layer(x), reference(layer, x), atol=1e-3)
