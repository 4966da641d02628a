"""Llama4ForConditionalGeneration (HF model_type llama4) <-> MaxText llama4 with use_multimodal=true: the
config.json fields of the vision tower and the places of its tensors (vision_model.*, multi_modal_projector.*)
in the Decoder's vision_encoder (vision.py). The text decoder's tensors are Llama4ForCausalLM's under
language_model. (hf.py's rules with that prefix). Every tensor moves by transposes and reshapes
only, so the round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert.hf_mapping import TOWER_KEYS, tower_layer
from MaxText.errors import ConfigError

ARCH = ("llama4", "Llama4ForConditionalGeneration")
VISION_KEYS = {  # vision_config field -> MaxText key: the tower's size and its pixel shuffle and adapter
  **TOWER_KEYS,
  "pixel_shuffle_ratio": "pixel_shuffle_ratio_for_vit",
  "projector_input_dim": "projector_input_dim_for_vit",
  "projector_output_dim": "projector_output_dim_for_vit",
}
LAYERNORM_EPSILON = 1e-5  # the vision tower's torch LayerNorms use the default eps, whatever norm_eps says


def maxtext_keys(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """A model_type=llama4 config.json -> (its text_config as a llama4_text config, the vision keys)."""
  text, vision = hf.get("text_config"), hf.get("vision_config")
  if not isinstance(text, dict) or not isinstance(vision, dict):
    raise ConfigError("model_type=llama4 config.json needs text_config and vision_config objects")
  if vision.get("vision_output_dim", vision.get("projector_output_dim")) != vision.get("projector_output_dim"):
    raise ConfigError(
      f"vision_config vision_output_dim={vision['vision_output_dim']} must equal projector_output_dim="
      f"{vision.get('projector_output_dim')} (the projector reads the adapter's output)"
    )
  keys: dict[str, Any] = {"use_multimodal": True, "vision_layer_norm_epsilon": LAYERNORM_EPSILON}
  for src, dst in VISION_KEYS.items():
    if src not in vision:
      raise ConfigError(f"config.json vision_config lacks the field {src!r}")
    keys[dst] = vision[src]
  rope = vision.get("rope_parameters") or {"rope_theta": vision.get("rope_theta", 10000.0)}
  keys["rope_theta_for_vit"] = float(rope["rope_theta"])
  keys["image_token_id"] = hf.get("image_token_index", 200092)
  keys["image_start_token_id"] = hf.get("boi_token_index", 200080)  # <|image_start|>, data/images.py
  keys["image_end_token_id"] = hf.get("eoi_token_index", 200081)  # <|image_end|>
  return {**text, "model_type": "llama4_text"}, keys


def hf_config(c: Any, text: dict[str, Any], dtype: str) -> dict[str, Any]:
  """The Llama4ForConditionalGeneration config.json around the text decoder's (`text`, llama4_text)."""
  text = {k: v for k, v in text.items() if k not in ("architectures", "dtype")}
  vision = {src: c[dst] for src, dst in VISION_KEYS.items()}
  vision |= {"model_type": "llama4_vision_model", "vision_output_dim": c.projector_output_dim_for_vit}
  vision |= {"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta_for_vit}}
  vision["norm_eps"] = c.vision_layer_norm_epsilon
  return {
    "model_type": ARCH[0],
    "architectures": [ARCH[1]],
    "dtype": dtype,
    "text_config": text,
    "vision_config": vision,
    "image_token_index": c.image_token_id,
    "boi_token_index": c.image_start_token_id,
    "eoi_token_index": c.image_end_token_id,
    "tie_word_embeddings": False,
  }


def rules(c: Any) -> Iterator[tuple[str, tuple[Any, ...], tuple[int, ...], int | None]]:
  """(HF name, path in the params pure dict, index: the slice of a stacked parameter, n_in: None to copy,
  else a torch Linear weight whose kernel has n_in input dims) for every tensor of the vision tower and
  projector."""
  v, root = "vision_model.", ("vision_encoder",)
  yield f"{v}patch_embedding.linear.weight", (*root, "patch_embedding", "kernel"), (), 1
  yield f"{v}class_embedding", (*root, "class_embedding"), (), None
  yield f"{v}positional_embedding_vlm", (*root, "positional_embedding"), (), None
  for norm in ("layernorm_pre", "layernorm_post"):
    yield f"{v}{norm}.weight", (*root, norm, "scale"), (), None
    yield f"{v}{norm}.bias", (*root, norm, "bias"), (), None
  for i in range(c.num_hidden_layers_for_vit):
    layer, (path, index) = f"{v}model.layers.{i}.", tower_layer(c, root, i)
    for norm in ("input_layernorm", "post_attention_layernorm"):
      yield f"{layer}{norm}.weight", (*path, norm, "scale"), index, None
      yield f"{layer}{norm}.bias", (*path, norm, "bias"), index, None
    for ours, theirs, n_in in (("query", "q", 1), ("key", "k", 1), ("value", "v", 1), ("out", "o", 2)):
      yield f"{layer}self_attn.{theirs}_proj.weight", (*path, ours, "kernel"), index, n_in
      yield f"{layer}self_attn.{theirs}_proj.bias", (*path, ours, "bias"), index, None
    for fc in ("fc1", "fc2"):
      yield f"{layer}mlp.{fc}.weight", (*path, fc, "kernel"), index, 1
      yield f"{layer}mlp.{fc}.bias", (*path, fc, "bias"), index, None
  yield f"{v}vision_adapter.mlp.fc1.weight", (*root, "adapter_fc1", "kernel"), (), 1
  yield f"{v}vision_adapter.mlp.fc2.weight", (*root, "adapter_fc2", "kernel"), (), 1
  yield "multi_modal_projector.linear_1.weight", (*root, "projector", "kernel"), (), 1
