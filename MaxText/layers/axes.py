"""Logical axis names of activations, one tuple per shape (letters from the legend in __init__.py).

Layers constrain activations with these names only; base.yml's logical_axis_rules map them to mesh axes.
Code that must run per shard (Pallas kernels, the MoE dispatch under shard_map) asks `mesh_axes` which
mesh axes the active rules give a logical name, so it never names a mesh axis itself.
"""

import math

import flax.linen as nn
import jax

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")  # [B, T, D]
HEAD_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_kv")  # [B, T, N, H]
KV_HEAD_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")  # [B, T, K, H]
MLP_AXES = ("activation_batch", "activation_length", "activation_mlp")  # [B, T, F]
LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")  # [B, T, V]
# MoE capacity buffers: experts over `expert`, their slots over the remaining batch axes.
EXPERT_EMBED_AXES = ("activation_exp", "activation_batch_no_exp", "activation_embed")  # [E, C, D]
EXPERT_MLP_AXES = ("activation_exp", "activation_batch_no_exp", "activation_mlp")  # [E, C, F]


def mesh_axes(logical: str, names: tuple[str, ...], mesh: jax.sharding.AbstractMesh) -> tuple[str, ...]:
  """The mesh axes (present in `mesh`, of size > 1) that the active logical axis rules give `logical`,
  one of the activation axis `names` (e.g. HEAD_AXES)."""
  spec = nn.logical_to_mesh_axes(names)
  entry = spec[names.index(logical)] if spec is not None else None
  axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
  return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def axes_size(axes: tuple[str, ...], mesh: jax.sharding.AbstractMesh) -> int:
  """Devices along `axes` of `mesh` (1 for none): how many pieces a dimension split over them has."""
  return math.prod(mesh.shape[a] for a in axes)
