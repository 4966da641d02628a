"""Context parallelism (ici_context_parallelism / ici_sequence_parallelism): losses and gradients equal the
unsplit model's on 8 fake CPU devices, with packing, sliding windows, GQA and the balanced layout."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, planner, sharding
from MaxText.errors import ConfigError
from MaxText.layers import context_parallel
from MaxText.objectives import lm
from MaxText.tests.helpers import built

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
# Tiny, float32; GQA (4 query heads over 2 kv heads); 64 tokens so 4 shards x 2 chunks x 8 tokens.
TINY = ["base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=48", "head_dim=8"]
TINY += ["base_num_decoder_layers=2", "vocab_size=128", "dtype=float32", "max_target_length=64"]
TINY += ["per_device_batch_size=1", "attention=dot_product"]
GEMMA2 = ["decoder_block=gemma2", "sliding_window_size=12", "attn_logits_soft_cap=50.0", "final_logits_soft_cap=30.0"]


def load(*overrides):
  return config.load([BASE, "run_name=t", *TINY, *overrides], {})


def packed_batch(rows: int, length: int = 64) -> dict[str, jax.Array]:
  """Rows of 3 documents of varied lengths and some padding (segment 0), positions restarting per doc."""
  rng = np.random.default_rng(0)
  segments = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(5, length - 4), 2, replace=False))
    bounds = [0, *cuts, length - 3]
    for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
      segments[r, a:b], positions[r, a:b] = doc, np.arange(b - a)
  tokens = rng.integers(1, 128, (rows, length)).astype(np.int32) * (segments > 0)
  targets = np.roll(tokens, -1, axis=1)
  batch = dict(inputs=tokens, targets=targets, inputs_segmentation=segments, targets_segmentation=segments)
  return {**{k: jnp.asarray(v) for k, v in batch.items()}, "inputs_position": jnp.asarray(positions)}


@functools.cache  # the unsplit reference is shared by the parametrized cases
def loss_and_grads(*overrides, rows: int = 8):
  """(loss per token, gradients) of one packed batch under the mesh the overrides give."""
  c = load(*overrides)
  mesh = sharding.create_mesh(c)
  graphdef, params = nnx.split(built(c, planner.build(c, mesh)), nnx.Param)
  batch = packed_batch(rows, c.max_target_length)
  with sharding.activate(c, mesh):
    placed = jax.device_put(
      params, sharding.logical_to_mesh(nnx.get_partition_spec(params), mesh, sharding.axis_rules(c))
    )
    grad_fn = jax.jit(jax.grad(functools.partial(lm.loss_sums, graphdef, c), has_aux=True))
    grads, aux = grad_fn(placed, batch, None)
  per_token = lambda x: np.asarray(x) / float(aux["tokens"])  # noqa: E731
  return float(aux["nll"]) / float(aux["tokens"]), jax.tree.map(per_token, grads)


def assert_same(got, want):
  assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got[1], want[1])


SLOW = pytest.mark.slow  # each case compiles a sharded train step: 30-60 s on 2 busy cores


@pytest.mark.parametrize(
  "mesh",
  [
    ["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "attention_query_chunk=4"],  # balanced, chunked
    pytest.param(["ici_context_parallelism=2", "ici_fsdp_parallelism=4"], marks=SLOW),
    pytest.param(["ici_context_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], marks=SLOW),
    pytest.param(
      ["ici_context_parallelism=2", "ici_sequence_parallelism=2", "ici_fsdp_parallelism=2", "attention_query_chunk=4"],
      marks=SLOW,
    ),
    pytest.param(
      ["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "context_parallel_load_balance=false"], marks=SLOW
    ),
  ],
)
def test_llama_matches_unsplit(mesh):
  """GQA, packed rows; whole-shard and query-chunked attention per shard."""
  want = loss_and_grads("ici_fsdp_parallelism=-1", "attention_query_chunk=0")
  assert_same(loss_and_grads("attention_query_chunk=0", *mesh), want)


@pytest.mark.parametrize(
  "mesh",
  [
    ["ici_context_parallelism=4", "ici_fsdp_parallelism=2", "attention_query_chunk=4"],
    pytest.param(["ici_context_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"], marks=SLOW),
  ],
)
def test_sliding_window_family_matches_unsplit(mesh):
  """gemma2: alternating local (window 12, crossing chunk and shard edges) and global layers, soft caps."""
  want = loss_and_grads(*GEMMA2, "ici_fsdp_parallelism=-1")
  assert_same(loss_and_grads(*GEMMA2, *mesh), want)


def test_balanced_layout_round_trips():
  x = jnp.arange(2 * 16).reshape(2, 16)
  assert context_parallel.chunk_order(2).tolist() == [0, 3, 1, 2]
  balanced = context_parallel.balance(x, 2)
  assert balanced[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
  assert context_parallel.original_index(16, 2, True).tolist() == balanced[0].tolist()
  np.testing.assert_array_equal(context_parallel.unbalance(balanced, 2), x)


def test_length_must_split_into_balanced_chunks():
  with pytest.raises(ConfigError, match="multiple of 8"):
    loss_and_grads(
      "ici_context_parallelism=4", "ici_fsdp_parallelism=2", "max_target_length=60", "attention_query_chunk=0"
    )
