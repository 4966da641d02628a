"""Llama 4's vision tower and projector between Hugging Face (Llama4ForConditionalGeneration: vision_model.*,
multi_modal_projector.*) and MaxText (the Decoder's vision_encoder, models/llama4_vision.py) tensors.

Every tensor is moved without arithmetic (transposes and reshapes only), so the round trip is bit-exact.
The text decoder's tensors (language_model.*) are those of Llama4ForCausalLM (hf_mapping's rules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

VISION = "vision_model."
PROJECTOR = "multi_modal_projector.linear_1.weight"
TEXT = "language_model."  # Llama4ForConditionalGeneration's prefix of the Llama4ForCausalLM tensors


def is_vision(hf_name: str) -> bool:
  return hf_name.startswith(VISION) or hf_name == PROJECTOR


def _layer_names(i: int) -> dict[tuple[str, str], str]:
  base = f"{VISION}model.layers.{i}."
  names = {
    ("input_layernorm", "scale"): "input_layernorm.weight",
    ("input_layernorm", "bias"): "input_layernorm.bias",
    ("post_attention_layernorm", "scale"): "post_attention_layernorm.weight",
    ("post_attention_layernorm", "bias"): "post_attention_layernorm.bias",
  }
  for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("out", "o_proj")):
    names |= {(ours, "kernel"): f"self_attn.{theirs}.weight", (ours, "bias"): f"self_attn.{theirs}.bias"}
  for fc in ("fc1", "fc2"):
    names |= {(fc, "kernel"): f"mlp.{fc}.weight", (fc, "bias"): f"mlp.{fc}.bias"}
  return {k: base + v for k, v in names.items()}


def _linear_to_maxtext(w: np.ndarray, name: str, heads: int) -> np.ndarray:
  """A torch Linear weight [out, in] -> our kernel [in, out], split into heads for q/k/v (in -> N, H) and o."""
  k = w.T
  if name in ("query", "key", "value"):
    return k.reshape(k.shape[0], heads, -1)
  if name == "out":
    return k.reshape(heads, -1, k.shape[1])
  return k


def to_maxtext(get: Callable[[str], np.ndarray], num_layers: int, heads: int) -> dict[str, Any]:
  """The vision_encoder's parameters as a pure dict (nnx.State.to_pure_dict layout) from HF tensors
  (`get(name)` returns one as a numpy array)."""
  out: dict[str, Any] = {
    "patch_embedding": {"kernel": get(f"{VISION}patch_embedding.linear.weight").T},
    "class_embedding": get(f"{VISION}class_embedding"),
    "positional_embedding": get(f"{VISION}positional_embedding_vlm"),
    "adapter_fc1": {"kernel": get(f"{VISION}vision_adapter.mlp.fc1.weight").T},
    "adapter_fc2": {"kernel": get(f"{VISION}vision_adapter.mlp.fc2.weight").T},
    "projector": {"kernel": get(PROJECTOR).T},
    "layers": {},
  }
  for norm in ("layernorm_pre", "layernorm_post"):
    out[norm] = {"scale": get(f"{VISION}{norm}.weight"), "bias": get(f"{VISION}{norm}.bias")}
  for i in range(num_layers):
    layer: dict[str, Any] = {}
    for (module, leaf), name in _layer_names(i).items():
      value = get(name)
      if leaf == "kernel":
        value = _linear_to_maxtext(value, module, heads)
      elif leaf == "bias" and module in ("query", "key", "value"):
        value = value.reshape(heads, -1)
      layer.setdefault(module, {})[leaf] = value
    out["layers"][i] = layer
  return out


def to_hf(params: dict[str, Any]) -> dict[str, np.ndarray]:
  """HF tensors (name -> numpy array) from the vision_encoder's pure-dict parameters (to_maxtext's inverse)."""
  p = params
  out = {
    f"{VISION}patch_embedding.linear.weight": np.asarray(p["patch_embedding"]["kernel"]).T,
    f"{VISION}class_embedding": np.asarray(p["class_embedding"]),
    f"{VISION}positional_embedding_vlm": np.asarray(p["positional_embedding"]),
    f"{VISION}vision_adapter.mlp.fc1.weight": np.asarray(p["adapter_fc1"]["kernel"]).T,
    f"{VISION}vision_adapter.mlp.fc2.weight": np.asarray(p["adapter_fc2"]["kernel"]).T,
    PROJECTOR: np.asarray(p["projector"]["kernel"]).T,
  }
  for norm in ("layernorm_pre", "layernorm_post"):
    out[f"{VISION}{norm}.weight"] = np.asarray(p[norm]["scale"])
    out[f"{VISION}{norm}.bias"] = np.asarray(p[norm]["bias"])
  for i, layer in p["layers"].items():
    for (module, leaf), name in _layer_names(int(i)).items():
      value = np.asarray(layer[module][leaf])
      if leaf == "kernel":
        flat = value.reshape(value.shape[0], -1) if module in ("query", "key", "value") else value
        value = flat.reshape(-1, flat.shape[-1]).T  # [in, out] (out: [N, H, D] -> [N*H, D]) -> [out, in]
      elif leaf == "bias":
        value = value.reshape(-1)
      out[name] = np.ascontiguousarray(value)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}
