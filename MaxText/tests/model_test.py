"""The llama2 decoder: shapes, logical axes, causality, packing masks, scan vs unrolled."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, models

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
TINY = ["base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=128"]
TINY += ["base_num_decoder_layers=2", "head_dim=16", "vocab_size=128", "max_target_length=16", "dtype=float32"]


def build(*overrides):
  c = config.load([BASE, "run_name=t", *TINY, *overrides], {})
  return c, models.build(c, nnx.Rngs(params=0))


def forward(model, tokens, segments=None, positions=None):
  b, t = tokens.shape
  segments = jnp.ones((b, t), jnp.int32) if segments is None else segments
  positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
  return model(tokens, positions, segments)


def tokens(b=2, t=16, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(1, 128, (b, t)), jnp.int32)


def test_logits_shape_and_params_carry_logical_axes():
  c, model = build()
  assert forward(model, tokens()).shape == (2, 16, 128)
  specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
  allowed = {"embed", "mlp", "vocab", "q_heads", "heads", "kv_heads", "kv", "norm", "layers"}
  assert specs and all(name in allowed for spec in specs for name in spec)


def test_gqa_param_shapes():
  _, model = build()
  attn = nnx.state(model, nnx.Param)["layers"]["self_attention"]
  assert attn["query"]["kernel"].shape == (2, 64, 4, 16)  # [L, D, N, H]
  assert attn["key"]["kernel"].shape == (2, 64, 2, 16)  # [L, D, K, H]


def test_causal():
  _, model = build()
  x = tokens()
  y = x.at[:, 10:].set(5)
  np.testing.assert_allclose(forward(model, x)[:, :10], forward(model, y)[:, :10], rtol=1e-6, atol=1e-6)
  assert not np.allclose(forward(model, x)[:, 10:], forward(model, y)[:, 10:])


def test_packed_documents_do_not_see_each_other():
  _, model = build()
  a, b = tokens(1, 6, seed=1), tokens(1, 10, seed=2)
  packed = jnp.concatenate([a, b], axis=1)
  segments = jnp.asarray([[1] * 6 + [2] * 10])
  positions = jnp.asarray([list(range(6)) + list(range(10))])
  out = forward(model, packed, segments, positions)
  np.testing.assert_allclose(out[:, :6], forward(model, a), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[:, 6:], forward(model, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [["logits_via_embedding=true"], ["logits_dot_in_fp32=true", "dtype=bfloat16"]])
def test_logit_variants(extra):
  _, model = build(*extra)
  assert np.isfinite(np.asarray(forward(model, tokens()), np.float32)).all()


def test_scan_and_unrolled_are_the_same_model():
  _, scanned = build("scan_layers=true")
  _, unrolled = build("scan_layers=false")
  np.testing.assert_allclose(forward(scanned, tokens()), forward(unrolled, tokens()), rtol=1e-5, atol=1e-5)


def test_unknown_decoder_block():
  with pytest.raises(ValueError, match="llama2"):
    build("decoder_block=llama9")
