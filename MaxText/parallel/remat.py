"""Remat policies by name (MaxText's `remat_policy` values): what the backward pass keeps of a layer's
forward activations and what it computes again. The one list of the names: config.CHOICES reads it.

The names that policies save are `checkpoint_name` tags in the layers: "query_proj", "key_proj",
"value_proj", "out_proj", "mlpwo", and "context" (the attention output before the out projection, the
fused kernel's result, expensive to remake). "*_offloaded" keep what they save in pinned host memory.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

_cp = jax.checkpoint_policies
QKV = ("query_proj", "key_proj", "value_proj")
_MINIMAL_WITH_CONTEXT = _cp.save_from_both_policies(
  _cp.checkpoint_dots_with_no_batch_dims, _cp.save_only_these_names("context")
)
POLICIES = {
  "full": _cp.nothing_saveable,
  "minimal": _cp.checkpoint_dots_with_no_batch_dims,
  "minimal_with_context": _MINIMAL_WITH_CONTEXT,
  "minimal_flash": _MINIMAL_WITH_CONTEXT,  # MaxText's second name for the same policy
  "save_dot_with_context_except_mlp": _cp.save_only_these_names(*QKV, "context", "out_proj"),
  "save_dot_except_mlpwi": _cp.save_only_these_names(*QKV, "out_proj", "mlpwo"),
  "save_dot_except_mlp": _cp.save_only_these_names(*QKV, "out_proj"),
  "save_qkv_proj": _cp.save_only_these_names(*QKV),
  "save_out_proj": _cp.save_only_these_names("out_proj"),
  "qkv_proj_offloaded": _cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=list(QKV), offload_src="device",
    offload_dst="pinned_host",
  ),
  "minimal_offloaded": _cp.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host"),
  "none": None,  # store every activation: no jax.checkpoint at all
}  # fmt: skip
NAMES = tuple(POLICIES)
# What each policy keeps of a layer's forward for the backward pass: on the chip (KEEPS) and in pinned host
# memory (OFFLOADS), by tag; "dots" is every matmul output without a batch dimension (q, k, v, out and the
# MLP's), "all" every activation. Nothing kept is computed again. autofit_estimate.py reads this.
KEEPS: dict[str, tuple[str, ...]] = {
  "full": (),
  "minimal": ("dots",),
  "minimal_with_context": ("dots", "context"),
  "minimal_flash": ("dots", "context"),
  "save_dot_with_context_except_mlp": (*QKV, "context", "out_proj"),
  "save_dot_except_mlpwi": (*QKV, "out_proj", "mlpwo"),
  "save_dot_except_mlp": (*QKV, "out_proj"),
  "save_qkv_proj": QKV,
  "save_out_proj": ("out_proj",),
  "qkv_proj_offloaded": (),
  "minimal_offloaded": (),
  "none": ("all",),
}
OFFLOADS: dict[str, tuple[str, ...]] = {"qkv_proj_offloaded": QKV, "minimal_offloaded": ("dots",)}


def remat(fn: Callable, policy: str, prevent_cse: bool) -> Callable:
  """fn wrapped in jax.checkpoint with the named policy; fn itself for "none"."""
  if POLICIES[policy] is None:
    return fn
  return jax.checkpoint(fn, policy=POLICIES[policy], prevent_cse=prevent_cse)
