"""Quantized training and weight-only serving rules through Qwix (docs/quantization.md).

Why Qwix and not AQT: Qwix intercepts the jax.lax.dot_general / jnp.einsum / jax.lax.ragged_dot calls our
layers already make and picks what to quantize by module path, so no layer takes a quantization argument;
it covers the dropless experts (ragged_dot), which AQT's dot_general/einsum wrappers do not; it serves the
same rules weight-only through its PtqProvider; it is NNX-native (AQT's Flax API is Linen). Its fake-quant
ops (qwix QtProvider, a custom VJP per matmul) feed int8 / fp8 operands to the dot itself, so XLA runs the
matmul in the low-precision type (int8 x int8 -> int32 on TPU).

quantization (config key):
  int8   weights and activations of every selected matmul in int8, gradients in int8 (quantization_gradients)
  fp8    the same in float8_e4m3fn forward, float8_e5m2 for the gradients; current (per-call) scaling
  int8w  weights only, int8; activations and gradients stay in `dtype` (training sees the serving weights)

Scales are symmetric `quantization_calibration_method` (absmax by default), computed on each call: one per
output channel of a weight and one per token of an activation (quantization_channelwise), optionally per
tile of `quantization_tile_size` along the contracted axis. Module paths are the NNX attribute paths
joined by "/" (e.g. layers/self_attention/query, layers/0/mlp/wi/1, moe_layers/mlp); `quantization_modules`
is a regex matched against the whole path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import qwix
from flax import nnx

from MaxText.config import Config

# What each mode quantizes to: (weights, activations, incoming gradients).
QTYPES = {
  "int8": (jnp.int8, jnp.int8, jnp.int8),
  "fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2),
  "int8w": (jnp.int8, None, None),
}
# config.CHOICES["quantization"] lists the same modes plus "" (off); config_test checks they agree.
MODES = ("", *QTYPES)

# The matmuls with a weight operand: DenseGeneral children (dot_general) and the routed experts, computed
# in the MoeBlock itself (jax.lax.ragged_dot when dropless, einsum with capacity). Attention's own einsums
# (scores, context), the router (mlp/gate), the MoE combine (mlp/combine), embeddings and logits are not.
OPS = ("dot_general", "einsum", "ragged_dot")


def enabled(config: Config) -> bool:
  return bool(config.quantization)


def rules(config: Config) -> list[qwix.QtRule]:
  """The Qwix rules of config.quantization ([] when off). int8w's rule has no activation or gradient
  type: QtProvider fake-quantizes the weights only, PtqProvider stores them as int8 for serving."""
  if not enabled(config):
    return []
  weight, act, grad = QTYPES[config.quantization]
  grad = grad if config.quantization_gradients else None
  method = config.quantization_calibration_method
  return [
    qwix.QtRule(
      module_path=config.quantization_modules,
      op_names=OPS,
      weight_qtype=weight,
      act_qtype=act,
      bwd_qtype=grad,
      weight_calibration_method=method,
      act_calibration_method=method if act is not None else None,
      tile_size=config.quantization_tile_size or None,
      disable_channelwise_axes=not config.quantization_channelwise,
    )
  ]


def quantize(model: nnx.Module, config: Config, method: str = "forward") -> nnx.Module:
  """`model` (from models.build) with its `method` intercepted by qwix.QtProvider(rules(config)); the
  model itself when quantization is off.

  Parameters are unchanged (same tree, shapes and values): dynamic (per-call) scales need no state, so
  the model is not run here and checkpoints load either way. What changes is the model's class (its
  `method` quantizes the selected matmuls) and the module paths Qwix stores on every submodule: both live
  in the graphdef that nnx.split returns, so train_step's nnx.merge(graphdef, params) gets them.
  """
  if not enabled(config):
    return model
  provider = qwix.QtProvider([_trainable(rule) for rule in rules(config)])
  return qwix.quantize_model(model, provider, methods=(method,), skip_nnx_init=True, **_NO_INPUTS)


def _trainable(rule: qwix.QtRule) -> qwix.QtRule:
  """The rule as QtProvider can run it: Qwix's quantized ragged_dot quantizes both operands, so a
  weight-only rule (int8w) leaves the dropless experts in `dtype` during training."""
  if rule.act_qtype is None:
    return dataclasses.replace(rule, op_names=tuple(op for op in rule.op_names if op != "ragged_dot"))
  return rule


# quantize_model requires some input for NNX models even when skip_nnx_init avoids calling it.
_NO_INPUTS: dict[str, Any] = {"tokens": None}
