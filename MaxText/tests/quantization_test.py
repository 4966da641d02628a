"""Quantized training (layers/quantization.py): which matmuls the rules select, int8 matmuls in the compiled
step (CPU, and a TPU topology through libtpu: ~6 s on a quiet machine), training that still learns, off
meaning unchanged, bad values failing at load."""

import glob
import os
import re

import jax
import numpy as np
import pytest
import qwix
from flax import nnx

from MaxText import models, optimizers, planner, sharding, train, train_compile
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.errors import ConfigError
from MaxText.layers import quantization
from MaxText.tests.conftest import TINY, cfg, losses
from MaxText.tests.helpers import compile_command

MOE = ("num_experts=4", "num_experts_per_tok=2", "shared_experts=1")

# An integer matmul as XLA prints it after optimisation: an s32 result of dot or convolution (TPU turns
# batched matmuls into convolutions). Only integer operands accumulate in s32.
INT8_MATMUL = re.compile(r"= s32\[[^\]]*\]\S* (dot|convolution)\(")
# The same before optimisation: a StableHLO dot_general of two i8 operands.
INT8_DOT_GENERAL = re.compile(r"stablehlo\.dot_general[^\n]*\(tensor<[^>]*xi8>, tensor<[^>]*xi8>\)")


def selected_ops(config):
  """(module path, op name) of every matmul the model's forward pass makes, with whether a rule picks it."""
  seen = {}

  class Recording(qwix.QtProvider):
    def _get_current_rule_and_op_id(self, op_name, **kwargs):
      rule, op_id = super()._get_current_rule_and_op_id(op_name, **kwargs)
      from qwix._src.utils import flax_util

      seen[("/".join(map(str, flax_util.get_current_module_path())), op_name)] = rule is not None
      return rule, op_id

  model = nnx.eval_shape(lambda: models.build(config, nnx.Rngs(params=0), planner.build(config)))
  model = qwix.quantize_model(
    model, Recording(quantization.rules(config)), methods=("forward",), skip_nnx_init=True, tokens=None
  )
  tokens = jax.ShapeDtypeStruct((2, config.max_target_length), np.int32)
  jax.eval_shape(lambda m, t: m.forward(t, t, t).logits, model, tokens)
  return seen


def test_rules_select_dense_and_expert_matmuls_only(tmp_path):
  seen = selected_ops(cfg(tmp_path, "r", "quantization=int8", *MOE))
  picked = {path for (path, op), chosen in seen.items() if chosen}
  left = {(path, op) for (path, op), chosen in seen.items() if not chosen}
  assert picked == {
    "layers/self_attention/query", "layers/self_attention/key", "layers/self_attention/value",
    "layers/self_attention/out", "layers/mlp",  # the routed experts (ragged_dot, dropless)
    "layers/mlp/shared_experts/wi/0", "layers/mlp/shared_experts/wi/1", "layers/mlp/shared_experts/wo",
  }  # fmt: skip
  # Attention's scores and context, the router, the combine of the experts' outputs, the logits.
  assert {path for path, _ in left} == {
    "layers/self_attention",
    "layers/mlp/gate",
    "layers/mlp/combine",
    "logits_dense",
  }
  dense = selected_ops(cfg(tmp_path, "d", "quantization=int8", "quantization_modules=.*mlp/wo"))
  assert {path for (path, _), chosen in dense.items() if chosen} == {"layers/mlp/wo"}


def test_rules_follow_the_mode_and_knobs(tmp_path):
  assert quantization.rules(cfg(tmp_path, "off")) == []
  int8 = quantization.rules(cfg(tmp_path, "i", "quantization=int8"))[0]
  assert (int8.weight_qtype, int8.act_qtype, int8.bwd_qtype) == (np.int8, np.int8, np.int8)
  fp8 = quantization.rules(cfg(tmp_path, "f", "quantization=fp8", "quantization_gradients=false"))[0]
  assert (fp8.weight_qtype, fp8.act_qtype, fp8.bwd_qtype) == (jax.numpy.float8_e4m3fn, jax.numpy.float8_e4m3fn, None)
  knobs = ("quantization_calibration_method=rms,3", "quantization_tile_size=128", "quantization_channelwise=false")
  weights_only = quantization.rules(cfg(tmp_path, "w", "quantization=int8w", *knobs))[0]
  assert (weights_only.weight_qtype, weights_only.act_qtype, weights_only.bwd_qtype) == (np.int8, None, None)
  assert weights_only.weight_calibration_method == "rms,3" and weights_only.tile_size == 128
  assert weights_only.disable_channelwise_axes


def test_off_builds_the_plain_model_and_every_mode_keeps_the_parameters(tmp_path):
  off = cfg(tmp_path, "off", *MOE)
  plan = planner.build(off)
  assert type(state_lib.build_model(off, 0, plan)) is type(models.build(off, nnx.Rngs(params=0), plan))
  plain = nnx.split(nnx.eval_shape(lambda: models.build(off, nnx.Rngs(params=0), planner.build(off))), nnx.Param)
  spec = state_lib.param_spec(off)
  assert spec.graphdef == plain[0]
  for mode in ("int8", "fp8", "int8w"):  # same parameter tree: checkpoints load with or without quantization
    got = state_lib.param_spec(cfg(tmp_path, mode, *MOE, f"quantization={mode}")).abstract
    assert jax.tree.structure(got) == jax.tree.structure(spec.abstract)
    assert jax.tree.leaves(got) == jax.tree.leaves(spec.abstract)


def trained_losses(tmp_path, mode):
  c = cfg(tmp_path, mode or "off", "steps=10", "per_device_batch_size=1", "vocab_size=16", f"quantization={mode}")
  train.run(c)
  return np.array(losses(c))


@pytest.fixture(scope="module")
def int8_losses(tmp_path_factory):
  """The int8 run's losses: one run for the two tests below."""
  return trained_losses(tmp_path_factory.mktemp("int8"), "int8")


def test_int8_training_learns(int8_losses):
  got = int8_losses
  assert np.isfinite(got).all() and got[-1] < got[0] - 0.2, got


@pytest.mark.slow
def test_fp8_training_learns_like_the_unquantized_model(tmp_path, int8_losses):
  """fp8 (emulated on CPU: XLA:CPU has no fp8 matmul, it upcasts) and int8 track the float32 losses."""
  ref = trained_losses(tmp_path, "")
  for mode in ("fp8", "int8"):
    got = trained_losses(tmp_path, mode) if mode == "fp8" else int8_losses
    assert np.isfinite(got).all() and got[-1] < got[0] - 0.2, (mode, got)
    np.testing.assert_allclose(got[-3:], ref[-3:], rtol=0.05, err_msg=mode)


def lowered_step(c):
  """train.py's step for the 8 CPU devices, lowered (jax.stages.Lowered)."""
  mesh = sharding.create_mesh(c)
  tx, schedule = optimizers.build(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, tx, mesh)
    batch, rng = train_compile.shaped_inputs(c, mesh)
    return steps.jit_train_step(c, mesh, tx, spec, schedule).lower(spec.abstract, batch, rng)


def test_int8_train_step_runs_int8_matmuls(tmp_path):
  """The int8 step multiplies int8 operands, accumulating in int32, after XLA's optimisations too; the
  unquantized step has no integer matmul."""
  lowered = lowered_step(cfg(tmp_path, "i", "quantization=int8", "per_device_batch_size=1"))
  assert INT8_DOT_GENERAL.search(lowered.as_text())
  assert len(INT8_MATMUL.findall(lowered.compile().as_text())) >= 7  # q, k, v, o, wi_0, wi_1, wo, gradients
  plain = lowered_step(cfg(tmp_path, "p", "per_device_batch_size=1"))
  assert not INT8_DOT_GENERAL.search(plain.as_text())


def test_int8_experts_sharded_over_the_batch_run_int8_matmuls(tmp_path):
  """Dropless experts inside their shard_map over 8 devices: Qwix's custom VJPs get their operands marked
  varying (moe.varying) and the compiled step multiplies int8 operands there too."""
  lowered = lowered_step(cfg(tmp_path, "i", "quantization=int8", *MOE, "per_device_batch_size=1"))
  assert len(INT8_MATMUL.findall(lowered.compile().as_text())) >= 10  # + 3 expert and 3 shared-expert matmuls


@pytest.mark.parametrize(
  "override, message",
  [
    ("quantization=int4", "quantization='int4' is not one of"),
    ("quantization_calibration_method=max", "quantization_calibration_method='max'"),
    ("quantization_calibration_method=rms", "rms,<k>"),
    ("quantization_modules=(mlp", "quantization_modules='(mlp' is not a valid regex"),
    ("quantization_tile_size=-1", "quantization_tile_size must be >= 0"),
  ],
)
def test_bad_values_fail_at_load_in_one_line(tmp_path, override, message):
  with pytest.raises(ConfigError, match=re.escape(message)) as e:
    cfg(tmp_path, "bad", override)
  assert "\n" not in str(e.value)


def test_int8_step_compiled_for_a_tpu_uses_int8_matmuls(tmp_path):
  """train_compile.py for a TPU topology (libtpu on this CPU): XLA:TPU's optimised program multiplies in
  int8 (s32 dots / convolutions)."""
  dump = tmp_path / "hlo"
  env = {"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"}
  overrides = [a for a in TINY if not a.startswith(("dataset_type", "log_config"))]
  overrides += ["compile_topology=v5e-8", "quantization=int8", f"base_output_directory={tmp_path}", "run_name=tpu"]
  result = compile_command(*overrides, env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  optimised = [p for p in glob.glob(str(dump / "*after_optimizations.txt")) if "train_step" in p]
  assert optimised, os.listdir(dump)
  text = "".join(open(p).read() for p in optimised)
  assert len(INT8_MATMUL.findall(text)) >= 7
