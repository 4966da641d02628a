"""The optimizers (opt_type): each trains a tiny model and resumes bit-exactly; the weight-decay mask, the
Muon/AdamW split of the parameters, and Praxis' Adam against optax's."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText import config, optimizers, sharding, state, train
from MaxText.errors import ConfigError
from MaxText.tests.conftest import DEEPSEEK3_TINY, cfg, losses, sized_config

# Per optimizer: what it needs to learn in a few steps (sgd: a larger step; adafactor: factor the tiny
# model's [64, 128] and [256, 64] matrices, which the default minimum of 128 would leave whole).
OPT_CASES = {
  "adamw": [],
  "adam_pax": [],
  "sgd": ["learning_rate=0.5"],
  "adafactor": ["adafactor_min_dim_size_to_factor=32"],
  "muon": ["muon_weight_decay=0.1"],
}


@pytest.mark.quick
def test_every_opt_type_has_a_builder():
  assert tuple(optimizers.OPTIMIZERS) == config.CHOICES["opt_type"]


@pytest.mark.slow  # three short runs (about 40 s on 2 cores) per optimizer
@pytest.mark.parametrize("opt_type", OPT_CASES)
def test_optimizer_learns_and_resumes_exactly(tmp_path, opt_type):
  """Uniform random tokens in [1, 16): the loss falls towards log(15) as the model learns their distribution."""
  common = ["per_device_batch_size=8", "vocab_size=16", "enable_checkpointing=true", "checkpoint_period=3"]
  common += ["async_checkpointing=false", "learning_rate_schedule_steps=6", f"opt_type={opt_type}"]
  common += ["adamw_mask=[norm,bias,embedding]", *OPT_CASES[opt_type]]
  one = jax.devices()[:1]
  full = cfg(tmp_path, "full", "steps=6", *common)
  train.run(full, one)
  train.run(cfg(tmp_path, "split", "steps=3", *common), one)
  split = cfg(tmp_path, "split", "steps=6", *common)
  assert train.run(split, one)["steps_run"] == 3
  assert sorted(os.listdir(split.checkpoint_dir)) == ["3", "6"]
  assert losses(split) == losses(full)  # bit-exact: the optimizer state was saved and restored whole
  assert losses(full)[-1] < losses(full)[0] - 0.05, losses(full)


def one_update(tmp_path, *overrides):
  """Params after one update from zero gradients (only weight decay moves them) and before it."""
  c = sized_config(
    tmp_path, "learning_rate=0.1", "warmup_steps_fraction=0", "gradient_clipping_threshold=0", *overrides
  )
  tx = optimizers.build(c).tx
  params = jax.tree.map(lambda p: p + 1.0, state.init_params(c, state.param_spec(c)))  # no zeros (biases)

  @jax.jit  # one compile; op by op, each of the update's many small ops compiled alone (~30 s a case)
  def update(params):
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    return optax.apply_updates(params, updates)

  return update(params), params


def moved(after, before):
  """{param path: whether the update changed it}"""
  flat = jax.tree_util.tree_leaves_with_path(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), after, before))
  return {optimizers.param_path(path): changed for path, changed in flat}


@pytest.mark.parametrize("opt_type", ["adamw", "adam_pax", "adafactor", "muon"])
def test_weight_decay_mask_leaves_norms_biases_and_embeddings_alone(tmp_path, opt_type):
  extra = [f"opt_type={opt_type}", "muon_weight_decay=0.1", "model_name=gpt3-175b", "override_model_config=true"]
  changed = moved(*one_update(tmp_path, *extra))  # gpt3: biases, norm biases, learned positions
  assert all(changed.values()), changed  # no mask (the default): everything decays
  changed = moved(*one_update(tmp_path, *extra, "adamw_mask=[norm,bias,embedding]"))
  kept = {p for p, c in changed.items() if not c}
  assert kept == {p for p in changed if "norm" in p or p.endswith("bias") or "embedding" in p}, kept
  assert "layers/mlp/wi/0/kernel" not in kept and "layers/self_attention/out/kernel" not in kept


def test_sgd_and_zero_decay_leave_weights_alone(tmp_path):
  for overrides in (["opt_type=sgd"], ["adam_weight_decay=0"]):
    assert not any(moved(*one_update(tmp_path, *overrides)).values()), overrides


def test_muon_takes_the_matrices_and_adamw_the_rest(tmp_path):
  c = sized_config(tmp_path, *DEEPSEEK3_TINY, "mtp_num_layers=1")
  abstract = state.param_spec(c).abstract
  is_param = optimizers._is_param
  flat = jax.tree_util.tree_leaves_with_path(
    jax.tree_util.tree_map_with_path(optimizers.muon_dimensions, abstract, is_leaf=is_param),
    is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers),
  )
  dims = {optimizers.param_path(path): d and (tuple(d.reduction_axis), tuple(d.output_axis)) for path, d in flat}
  # [layers, D, N, H]: in D, out (N, H); [layers, N, H, D]: in (N, H), out D; experts [layers, E, D, F]
  assert dims["moe_layers/self_attention/wq_a/kernel"] == ((1,), (2,))
  assert dims["moe_layers/self_attention/wkv_b/kernel"] == ((1,), (2, 3))
  assert dims["moe_layers/self_attention/out/kernel"] == ((1, 2), (3,))
  assert dims["moe_layers/mlp/wi_0"] == ((2,), (3,)) and dims["moe_layers/mlp/wo"] == ((2,), (3,))
  assert dims["moe_layers/mlp/gate/kernel"] == ((1,), (2,))
  assert dims["mtp_modules/0/layer/mlp/wo"] == ((1,), (2,))  # not stacked: only the expert axis is batch
  assert dims["mtp_modules/0/eh_proj/kernel"] == ((0,), (1,))
  for adam in ("token_embedder/embedding", "logits_dense/kernel", "decoder_norm/scale", "moe_layers/mlp/gate_bias"):
    assert dims[adam] is None, adam


@pytest.mark.parametrize("opt_type", ["adafactor", "muon"])
def test_factored_and_partitioned_states_shard(tmp_path, opt_type):
  """Adafactor's factored statistics (fewer dims than their parameter's axis names) and Muon's masked halves
  (optax's MaskedNode) get shardings of the state's own structure on an 8-device mesh."""
  c = sized_config(tmp_path, f"opt_type={opt_type}", "adafactor_min_dim_size_to_factor=32", "ici_fsdp_parallelism=8")
  spec = state.state_spec(c, optimizers.build(c).tx, sharding.create_mesh(c))
  assert jax.tree.structure(spec.shardings) == jax.tree.structure(spec.abstract)
  assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(spec.shardings.opt_state))


@pytest.mark.quick
def test_pax_adam_equals_bias_corrected_adam():
  """Praxis folds Adam's bias correction into its decay rates: the same update up to rounding."""
  grads = [{"w": jax.random.normal(jax.random.key(i), (3, 5))} for i in range(4)]
  pax, ref = optimizers.scale_by_pax_adam(0.9, 0.95, 1e-8, 0.0), optax.scale_by_adam(0.9, 0.95, 1e-8)
  pax_state, ref_state = pax.init(grads[0]), ref.init(grads[0])
  for g in grads:
    got, pax_state = pax.update(g, pax_state)
    want, ref_state = ref.update(g, ref_state)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize(
  "override, message",
  [
    ("opt_type=adam", "opt_type='adam' is not one of"),
    ("adamw_mask=['(']", "adamw_mask: '\\(' is not a regular expression"),
    ("adamw_mask=[1]", "adamw_mask takes regexes"),
    ("muon_beta=1", "muon_beta must be in"),
    ("adafactor_decay_rate=0", "adafactor_decay_rate must be in"),
  ],
)
def test_bad_optimizer_keys_fail_at_load(tmp_path, override, message):
  with pytest.raises(ConfigError, match=message):
    cfg(tmp_path, "bad", override)
