"""Logical axis names of activations, one tuple per shape (letters from the legend in __init__.py).

Layers constrain activations with these names only; base.yml's logical_axis_rules map them to mesh axes.
Code that must run per shard (Pallas kernels, the MoE dispatch) gets the mesh axes of these names from
the run plan (parallel/plan.py), so no layer names a mesh axis itself.
"""

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")  # [B, T, D]
HEAD_AXES = ("activation_batch", "activation_length", "activation_heads", "activation_kv")  # [B, T, N, H]
KV_HEAD_AXES = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")  # [B, T, K, H]
MLP_AXES = ("activation_batch", "activation_length", "activation_mlp")  # [B, T, F]
LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")  # [B, T, V]
# MoE capacity buffers: experts over `expert`, their slots over the remaining batch axes.
EXPERT_EMBED_AXES = ("activation_exp", "activation_batch_no_exp", "activation_embed")  # [E, C, D]
EXPERT_MLP_AXES = ("activation_exp", "activation_batch_no_exp", "activation_mlp")  # [E, C, F]
