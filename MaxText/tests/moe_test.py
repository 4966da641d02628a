"""MoE layer: dropless ragged_dot equals a dense per-expert reference; capacity dispatch equals dropless
when nothing is dropped and a per-token loop otherwise, sharded or not; balance loss; gradients."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import config, optimizers, planner, sharding, state, train_step
from MaxText.errors import ConfigError
from MaxText.layers import moe
from MaxText.layers.model_config import ModelConfig
from MaxText.objectives import lm
from MaxText.tests.conftest import DEEPSEEK3_TINY, NIGHTLY, cfg

BASE = os.path.join(config.CONFIG_DIR, "base.yml")
TINY = ["base_emb_dim=16", "base_mlp_dim=24", "num_experts=4", "num_experts_per_tok=2", "dtype=float32"]


def block(*overrides, mesh=None):
  """The layer, run as the plan for `mesh` says (None: one device)."""
  c = config.load([BASE, "run_name=t", *TINY, *overrides], {})
  with nnx.use_eager_sharding(False):
    return moe.MoeBlock(ModelConfig.from_config(c), rngs=nnx.Rngs(params=0), plan=planner.build(c, mesh))


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


@pytest.mark.quick
def test_dropless_matches_dense_reference_and_records_balance_loss():
  layer = block()
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  np.testing.assert_allclose(layer(x), reference(layer, x), rtol=1e-5, atol=1e-5)
  assert float(layer.load_balance_loss[...]) > 0.5  # k (= 2) when perfectly balanced


def loop_reference(layer, x, capacity):
  """Token by token, slot by slot (numpy): an assignment counts only while its expert has had fewer
  than `capacity` earlier ones. Returns the output and how many assignments were dropped."""
  tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  routing = moe.route(layer.gate(x.reshape(tokens.shape)), layer.config)
  experts, weights = np.asarray(routing.experts), np.asarray(routing.weights, np.float64)
  wi_0, wi_1, wo = (np.asarray(w[...], np.float64) for w in (layer.wi_0, layer.wi_1, layer.wo))
  seen, dropped, out = np.zeros(layer.num_experts, int), 0, np.zeros_like(tokens)
  for i, token in enumerate(tokens):
    for e, w in zip(experts[i], weights[i]):
      if seen[e] < capacity:
        h = token @ wi_0[e]
        out[i] += w * ((h / (1 + np.exp(-h))) * (token @ wi_1[e])) @ wo[e]
      else:
        dropped += 1
      seen[e] += 1
  return out.reshape(x.shape), dropped


@pytest.mark.quick
def test_capacity_mask_keeps_earlier_tokens():
  experts = jnp.asarray([[0, 1], [0, 1], [0, 2], [3, 0]])
  keep = moe.capacity_mask(experts, num_experts=4, capacity_factor=1.0)  # capacity = ceil(8 / 4) = 2
  np.testing.assert_array_equal(keep, [[True, True], [True, True], [False, True], [True, False]])
  np.testing.assert_array_equal(moe.expert_ranks(experts, 4), [[0, 0], [1, 1], [2, 0], [0, 3]])


def test_capacity_without_drops_equals_dropless():
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  # ceil(2 * 16 tokens * 2 / 4) = 16 slots: every token fits in every expert.
  np.testing.assert_allclose(block("capacity_factor=2.0")(x), block()(x), rtol=1e-6, atol=1e-6)


@pytest.mark.quick
def test_small_capacity_equals_token_loop_and_buffer_is_static():
  layer = block("capacity_factor=0.5")
  x = jax.random.normal(jax.random.key(1), (2, 8, 16))
  capacity = math.ceil(0.5 * 16 * 2 / 4)  # 4 slots per expert for 32 assignments
  want, dropped = loop_reference(layer, x, capacity)
  assert 0 < dropped < 32
  np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), want, rtol=1e-5, atol=1e-5)
  # The experts run on the [E, C, F] = [4, 4, 24] buffer only: dropped assignments cost nothing.
  graphdef, params = nnx.split(block("capacity_factor=0.5"), nnx.Param)
  assert "f32[4,4,24]" in str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(x))(params))


def test_capacity_gradients_are_finite_and_balance_loss_is_reported():
  layer = block("capacity_factor=0.5")
  x = jax.random.normal(jax.random.key(2), (2, 8, 16))

  def loss(m):
    out = m(x)
    return jnp.sum(out**2) + m.load_balance_loss[...]

  grads = nnx.jit(nnx.grad(loss))(layer)  # jitted: op by op, each small op compiles alone (~30 s)
  for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
    assert np.all(np.isfinite(g)) and np.any(g != 0), path
  nnx.jit(lambda m: m(x))(layer)
  assert float(layer.load_balance_loss[...]) > 0.5


@pytest.mark.parametrize("capacity_factor", ["0.0", "0.5"])
def test_sharded_equals_unsharded(capacity_factor):
  """data x fsdp x expert mesh: experts (and the capacity buffer) split over `expert`."""
  args = [f"capacity_factor={capacity_factor}", "ici_data_parallelism=2", "ici_expert_parallelism=2"]
  c = config.load([BASE, "run_name=t", *TINY, *args], {})
  mesh = sharding.create_mesh(c)
  graphdef, params = nnx.split(block(*args), nnx.Param)
  sharded = nnx.split(block(*args, mesh=mesh), nnx.Param)[0]
  x = jax.random.normal(jax.random.key(3), (8, 4, 16))
  expected = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
  with sharding.activate(c, mesh):
    shardings = sharding.logical_to_mesh(nnx.get_partition_spec(params), mesh, sharding.axis_rules(c))
    placed = jax.device_put(params, shardings)
    got = jax.jit(lambda p, x: nnx.merge(sharded, p)(x))(placed, x)
  assert mesh.shape["expert"] == 2 and mesh.shape["fsdp"] == 2
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_dropless_per_shard_dispatch_equals_unsharded_values_and_gradients():
  """data x fsdp x tensor mesh, no expert axis: each batch shard routes its own tokens (shard_map) with
  the expert width split over `tensor`; values and gradients equal the single-device computation."""
  args = ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
  c = config.load([BASE, "run_name=t", *TINY, *args], {})
  mesh = sharding.create_mesh(c)
  graphdef, params = nnx.split(block(*args), nnx.Param)
  sharded = nnx.split(block(*args, mesh=mesh), nnx.Param)[0]
  x = jax.random.normal(jax.random.key(4), (8, 4, 16))

  def loss(graphdef):
    return lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x)))

  expected, expected_grads = jax.jit(jax.value_and_grad(loss(graphdef)))(params, x)
  with sharding.activate(c, mesh):
    shardings = sharding.logical_to_mesh(nnx.get_partition_spec(params), mesh, sharding.axis_rules(c))
    step = jax.jit(jax.value_and_grad(loss(sharded)))
    got, grads = step(jax.device_put(params, shardings), x)
    assert "shard_map" in str(step.trace(jax.device_put(params, shardings), x).jaxpr)
  np.testing.assert_allclose(float(got), float(expected), rtol=1e-5)
  for (path, g), (_, want) in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(expected_grads)
  ):
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=str(path))


@pytest.mark.parametrize("base_moe_mlp_dim, expert_width", [(0, 48), (8, 16)])
def test_expert_widths_scale_once_with_global_parameter_scale(base_moe_mlp_dim, expert_width):
  """global_parameter_scale=2 doubles mlp widths once: routed experts are moe_mlp_dim wide (base_moe_mlp_dim,
  or base_mlp_dim = 24 when 0, times 2) and the shared experts one MLP of shared_experts * moe_mlp_dim, as
  in DeepSeek and MaxText (not scaled a second time)."""
  layer = block("global_parameter_scale=2", f"base_moe_mlp_dim={base_moe_mlp_dim}", "shared_experts=2")
  assert layer.wi_0.shape == (4, 16, expert_width)
  assert layer.shared_experts.wo.kernel.shape == (2 * expert_width, 16)


# ---------------------------------------------------------------- auxiliary-loss-free balancing (routed_bias)


@pytest.mark.quick
def test_expert_load_counts_every_assignment_and_is_not_a_loss():
  layer = block("routed_bias=true", "routed_score_func=sigmoid")
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  layer(x)
  routing = moe.route(layer.gate(x.reshape(-1, 16)), layer.config, layer.gate_bias[...])
  load = np.asarray(layer.expert_load[...])
  np.testing.assert_array_equal(load, np.bincount(np.asarray(routing.experts).ravel(), minlength=4))
  assert load.dtype == np.int32 and load.sum() == 2 * 8 * 2  # X * k
  assert set(nnx.state(layer, nnx.All(nnx.Intermediate, nnx.Not(moe.ExpertLoad)))) == {"load_balance_loss"}


@pytest.mark.quick
def test_balance_router_bias_moves_each_bias_one_step_towards_the_mean_load():
  params = {"moe_layers": {"mlp": {"gate_bias": jnp.zeros((2, 4)), "wo": jnp.ones((2, 3))}}}
  loads = {"moe_layers": {"mlp": {"expert_load": jnp.asarray([[8, 0, 4, 4], [4, 4, 4, 4]], jnp.int32)}}}
  out = train_step.balance_router_bias(params, loads, 0.5)
  np.testing.assert_array_equal(out["moe_layers"]["mlp"]["gate_bias"], [[-0.5, 0.5, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(out["moe_layers"]["mlp"]["wo"], params["moe_layers"]["mlp"]["wo"])
  assert float(lm.max_load_ratio(loads)) == 2.0


def _is_bias(path) -> bool:
  return optimizers.param_path(path).endswith("gate_bias")


def _biases(params) -> dict:
  """{path: gate_bias} of every router."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return {optimizers.param_path(p): np.asarray(x) for p, x in leaves if _is_bias(p)}


def _balance_run(tmp_path, steps, *overrides):
  """A tiny deepseek3 whose routers all start with gate_bias [2, 0, 0, 0] (expert 0's group wins every token:
  its top-2 sum beats any other group's, at most 2), trained `steps` steps on one fixed batch: (gate biases
  before, after, per-step moe_max_load_ratio)."""
  c = cfg(tmp_path, "b", *DEEPSEEK3_TINY, "per_device_batch_size=8", *overrides)
  mesh = sharding.create_mesh(c, devices=jax.devices()[:1])
  opt = optimizers.build(c)
  skew = jnp.asarray([2.0, 0.0, 0.0, 0.0])
  tokens = np.random.default_rng(0).integers(1, c.vocab_size, (8, c.max_target_length), dtype=np.int32)
  ones = np.ones_like(tokens)
  batch = {"inputs": tokens, "targets": tokens, "inputs_segmentation": ones, "targets_segmentation": ones}
  batch["inputs_position"] = np.broadcast_to(np.arange(c.max_target_length, dtype=np.int32), tokens.shape)
  with sharding.activate(c, mesh):
    spec = state.state_spec(c, opt.tx, mesh)
    s = state.init_state(c, opt.tx, spec)
    s = s.replace(params=jax.tree_util.tree_map_with_path(lambda p, x: x + skew if _is_bias(p) else x, s.params))
    before = _biases(s.params)
    step = train_step.jit_train_step(c, mesh, opt.tx, spec, opt.schedule)
    batch = jax.device_put(batch, train_step.batch_shardings(c, mesh))
    ratios = []
    for i in range(steps):
      s, metrics = step(s, batch, jax.random.key(i))
      ratios.append(float(metrics.get("moe_max_load_ratio", np.nan)))
  return before, _biases(s.params), ratios


# Scanned layers in the whole suite; unrolled (the same update on another parameter tree) nightly (conftest.NIGHTLY).
@pytest.mark.parametrize("scan", ["true", pytest.param("false", marks=NIGHTLY)])
@pytest.mark.slow  # about 18 s each on 2 cores
def test_bias_update_evens_out_a_skewed_router_and_nothing_else_moves_the_bias(tmp_path, scan):
  """The busiest expert's load falls from twice the mean (expert 0's group takes every token) to near it. The
  model trains meanwhile, with weight decay, yet every bias moves by whole steps of +-rate only: the optimizer
  (no gradient reaches the bias; weight decay would shrink it) has no part in it."""
  rate = 0.04
  overrides = [f"scan_layers={scan}", f"routed_bias_update_rate={rate}", "mtp_num_layers=1", "adam_weight_decay=0.5"]
  before, after, ratios = _balance_run(tmp_path, 24, *overrides)
  assert len(before) == (2 if scan == "true" else 3)  # the MoE stack (or its 2 layers) and the MTP layer
  assert ratios[0] == 2.0 and np.mean(ratios[-6:]) < 1.4, ratios
  for path, b in before.items():
    steps_moved = np.abs(after[path] - b) / rate
    np.testing.assert_allclose(steps_moved, np.round(steps_moved), atol=1e-3)  # whole steps of +-rate
    assert after[path][..., 0].max() < b[..., 0].min() - 10 * rate, (path, after[path])  # the favourite went down


def test_without_the_load_rule_the_bias_stays_put(tmp_path):
  """routed_bias_update_rate=0: a large learning rate and weight decay train everything but the bias."""
  before, after, _ = _balance_run(tmp_path, 2, "learning_rate=0.1", "adam_weight_decay=0.5")
  for path, b in before.items():
    np.testing.assert_array_equal(after[path], b)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["routed_bias_update_rate=0.001"], "needs num_experts > 1 and routed_bias=true"),
    (["routed_bias_update_rate=-1"], "routed_bias_update_rate must be >= 0"),
    ([*DEEPSEEK3_TINY, "routed_bias_update_rate=0.001", "lora_rank=4"], "not supported with pipeline .* or LoRA"),
    ([*DEEPSEEK3_TINY, "routed_bias_update_rate=0.001", "ici_pipeline_parallelism=2"], "not supported with pipeline"),
  ],
)
def test_bias_update_rate_needs_a_selection_bias_and_no_pipeline_or_lora(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    cfg(tmp_path, "bad", *overrides)
