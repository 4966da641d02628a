"""Checkpoints whose layout differs from the model's, fitted to it on restore (checkpointing.py calls these):
params saved with the other scan_layers setting (layers stacked on a leading axis or one subtree per layer),
and upstream MaxText's checkpoints (its Linen train states and NNX params, renamed ours by convert/upstream.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from MaxText.convert import upstream
from MaxText.errors import ConfigError
from MaxText.state import TrainState


def restore_other_layout(path: str, tree: Any, abstract_params: Any) -> Any | None:
  """A checkpoint written with the other scan_layers setting, restacked or unstacked to
  `abstract_params` (via host memory: the whole params once); None when it is not that."""
  numpy_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  saved = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=numpy_args))
  saved = saved.get("params", saved)
  target = nnx.to_pure_dict(abstract_params)
  try:
    pure = relayout(target, saved)
  except (KeyError, ValueError, TypeError):
    return None
  placed = jax.tree.map(lambda a, t: jax.device_put(a.astype(t.dtype), t.sharding), pure, target)
  out = jax.tree.map(lambda x: x, abstract_params)
  nnx.replace_by_pure_dict(out, placed)
  return out


def relayout(target: Any, saved: Any) -> Any:
  """saved (str keys, {'value': array} leaves, or plain arrays as in a quantized params checkpoint) in the
  shape of target (a pure dict of abstract arrays): a stacked target subtree takes saved layers '0'..'n-1'
  stacked; an unrolled one slices saved stacks."""
  if not isinstance(target, dict):
    array = saved["value"] if isinstance(saved, dict) and set(saved) == {"value"} else saved
    if isinstance(array, dict) or tuple(array.shape) != tuple(target.shape):
      raise ValueError(f"shape {getattr(array, 'shape', None)} != {target.shape}")
    return array
  if not isinstance(saved, dict):
    raise ValueError(f"an array where the model has {sorted(target)}")
  digits = all(k.isdigit() for k in saved)
  target_list = all(isinstance(k, int) for k in target)
  if digits and not target_list:  # target stacked, saved unrolled
    layers = [saved[str(i)] for i in range(len(saved))]
    return jax.tree.map(lambda *xs: np.stack(xs), *[relayout(_unstacked(target), layer) for layer in layers])
  if target_list and not digits:  # target unrolled, saved stacked
    return {i: relayout(target[i], jax.tree.map(lambda x, i=i: x[i], saved)) for i in target}
  return {k: _relayout_child(target[k], saved, str(k)) for k in target}


class _Mismatch(ValueError):
  """Where (the parameter's path) and why a saved tree does not fit the model's."""

  def __init__(self, path: list[str], why: str):
    self.path, self.why = path, why
    super().__init__(f"{'/'.join(path)}: {why}")


def _relayout_child(target: Any, saved: dict, key: str) -> Any:
  if key not in saved:
    raise _Mismatch([key], "not in the checkpoint")
  try:
    return relayout(target, saved[key])
  except _Mismatch as e:
    raise _Mismatch([key, *e.path], e.why) from None
  except (KeyError, ValueError, TypeError) as e:
    raise _Mismatch([key], str(e)) from None


def _unstacked(target: Any) -> Any:
  """Abstract arrays without their leading (layers) axis."""
  return jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], t.dtype), target)


def restore_numpy(path: str, params_tree: Any, kind: str, **more: Any) -> Any:
  """An upstream MaxText checkpoint's parameters (plus the top-level items `more` names, as metadata
  subtrees) as host numpy arrays; nothing else is read (a train state's optimizer stays on disk)."""
  item = {"params": {"params": params_tree}} if kind == "linen" else dict(params_tree)
  item.update(more)
  abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), item)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  restored = ocp.PyTreeCheckpointer().restore(
    path, args=ocp.args.PyTreeRestore(item=abstract, restore_args=args, partial_restore=True)
  )
  return restored if more else upstream.params_of(restored, kind)


def with_routing_biases(path: str, tree: Any, params: dict) -> dict:
  """Upstream params `params` (its Linen names, host arrays) plus the deepseek routing biases (gate/bias) that a
  Linen train state of `tree` (its metadata) keeps outside them, in nnx_aux (stacked on axis 0 there; moved to
  the params' scan axis)."""
  aux = tree.get("nnx_aux")
  wanted = _gate_biases(aux["model"].get("decoder", {})) if isinstance(aux, dict) and "model" in aux else None
  if not wanted:
    return params
  item = {"nnx_aux": {"model": {"decoder": wanted}}}
  abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), item)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  restored = ocp.PyTreeCheckpointer().restore(
    path, args=ocp.args.PyTreeRestore(item=abstract, restore_args=args, partial_restore=True)
  )["nnx_aux"]["model"]["decoder"]
  move = lambda k, v: jax.tree.map(lambda b: np.moveaxis(b, 0, upstream.SCAN_AXIS), v) if k in upstream.STACKS else v  # noqa: E731
  return {**params, "decoder": _merged(params["decoder"], {k: move(k, v) for k, v in restored.items()})}


def _gate_biases(tree: Any) -> dict | None:
  """The subtree of `tree` (a module's variables) holding only its gate/bias leaves, or None without any."""
  if not isinstance(tree, dict):
    return None
  out = {k: v for k, v in {k: _gate_biases(v) for k, v in tree.items() if k != "gate"}.items() if v}
  if isinstance(tree.get("gate"), dict) and "bias" in tree["gate"]:
    out["gate"] = {"bias": tree["gate"]["bias"]}
  return out or None


def _merged(tree: dict, more: dict) -> dict:
  """`tree` with the leaves of `more` (nested dicts) added."""
  out = dict(tree)
  for k, v in more.items():
    out[k] = _merged(out.get(k, {}), v) if isinstance(v, dict) else v
  return out


def placed(path: str, key: str, saved: Any, abstract: Any) -> Any:
  """Host arrays in our names (upstream.to_ours) fitted to `abstract` (nnx.State of abstract arrays, scanned
  or not) and placed on its shardings in its dtypes."""
  target = nnx.to_pure_dict(abstract)
  try:
    pure = relayout(target, saved)
  except (KeyError, ValueError, TypeError) as e:
    raise ConfigError(
      f"{key} {path!r} is an upstream MaxText checkpoint that does not map onto this model: {e}; "
      "set the model keys (model_name, base_emb_dim, num_experts, ...) it was trained with (docs/checkpoints.md)"
    ) from e
  placed = jax.tree.map(lambda a, t: jax.device_put(np.asarray(a).astype(t.dtype), t.sharding), pure, target)
  out = jax.tree.map(lambda x: x, abstract)
  nnx.replace_by_pure_dict(out, placed)
  return out


def upstream_params(path: str, tree: Any, abstract_params: Any, config: Any) -> Any:
  """An upstream MaxText checkpoint's params (either layout) as ours, for load_parameters_path: the family of
  `config` (the run's Config) must be one upstream.FAMILIES maps (a ConfigError names it otherwise)."""
  if config is None:
    raise ConfigError(f"{path!r} is an upstream MaxText checkpoint; only load_parameters_path reads those")
  fam, kind = upstream.family(config), upstream.layout(tree)
  saved = restore_numpy(path, upstream.params_of(tree, kind), kind)
  saved = upstream.to_ours(with_routing_biases(path, tree, saved) if kind == "linen" else saved, fam)
  return placed(path, "load_parameters_path", saved, abstract_params)


def restore_upstream_state(
  path: str, tree: dict, abstract: TrainState, fresh: Callable[[Any], Any], config: Any
) -> TrainState:
  """An upstream MaxText train state (its Linen tree) as ours: params, step, and its AdamW moments and counts
  into our optimizer state (the rest of ours, e.g. skip_spikes' history, starts as fresh(params) has it: the
  optimizer's initial state around the restored params)."""
  key = "load_full_state_path"
  fam = upstream.family(config)
  if upstream.layout(tree) != "linen" or "opt_state" not in tree:
    raise ConfigError(f"{key} {path!r} is an upstream MaxText params-only checkpoint; pass it as load_parameters_path")
  adam = upstream.adam_of(tree["opt_state"])
  if adam is None:
    raise ConfigError(
      f"{key} {path!r}: its optimizer state has no AdamW moments (upstream opt_type other than adamw); "
      "load its parameters with load_parameters_path instead"
    )
  saved = restore_numpy(path, tree["params"]["params"], "linen", step=tree["step"], opt_state=tree["opt_state"])
  count, mu, nu = upstream.adam_of(saved["opt_state"])
  params = with_routing_biases(path, tree, saved["params"]["params"])
  params = placed(path, key, upstream.to_ours(params, fam), abstract.params)
  fit = lambda moment, like: placed(path, key, upstream.to_ours(moment.get("params", moment), fam.for_moments()), like)  # noqa: E731
  opt_state = upstream.with_adam(fresh(params), count, mu, nu, fit)
  if opt_state is None:
    raise ConfigError(f"{key} {path!r}: this run's optimizer has no AdamW state to take the checkpoint's moments")
  opt_state = jax.device_put(opt_state, jax.tree.map(lambda a: a.sharding, abstract.opt_state))
  step = jax.device_put(np.asarray(saved["step"], np.int32), abstract.step.sharding)
  return TrainState(step=step, params=params, opt_state=opt_state)
