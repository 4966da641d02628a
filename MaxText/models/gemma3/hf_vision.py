"""Gemma3ForConditionalGeneration (HF model_type gemma3) <-> gemma3 with use_multimodal=true: the config.json
fields of the SigLIP tower and Gemma 3's projector, and the places of their tensors (vision_tower.*,
multi_modal_projector.*) in the Decoder's vision_encoder (layers/vision.VisionEncoder)."""

from __future__ import annotations

from typing import Any

from MaxText.convert import hf_mapping
from MaxText.convert.hf_mapping import Rule
from MaxText.errors import ConfigError

VISION_KEYS = {**hf_mapping.TOWER_KEYS, "layer_norm_eps": "vision_layer_norm_epsilon"}  # vision_config -> ours
VISION_DEFAULTS = {"num_channels": 3, "layer_norm_eps": 1e-6}


def maxtext_keys(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """A model_type=gemma3 config.json -> (its text_config as a gemma3_text config, the vision keys)."""
  vision = {**VISION_DEFAULTS, **hf["vision_config"]}
  if vision.get("vision_use_head"):
    raise ConfigError("vision_config.vision_use_head=true is not supported (Gemma 3 uses the patch outputs)")
  text = {"model_type": "gemma3_text", **hf["text_config"]}
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
  out = {dst: vision[src] for src, dst in VISION_KEYS.items()}
  out["mm_tokens_per_image"] = hf.get("mm_tokens_per_image", 256)
  out["image_token_id"] = hf.get("image_token_index", hf.get("image_token_id", 262144))
  out["image_start_token_id"] = hf.get("boi_token_index", hf.get("boi_token_id", 255999))
  out["image_end_token_id"] = hf.get("eoi_token_index", hf.get("eoi_token_id", 256000))
  return text, out


def hf_config(c: Any, text: dict[str, Any], dtype: str) -> dict[str, Any]:
  """The Gemma3ForConditionalGeneration config.json around the text model's (`text`, gemma3_text)."""
  vision = {src: c[dst] for src, dst in VISION_KEYS.items()}
  vision |= {"model_type": "siglip_vision_model", "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
  text = {k: v for k, v in text.items() if k not in ("architectures", "dtype")} | {"model_type": "gemma3_text"}
  out = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "dtype": dtype}
  out |= {"text_config": text, "vision_config": vision, "mm_tokens_per_image": c.mm_tokens_per_image}
  out |= {"image_token_index": c.image_token_id, "tie_word_embeddings": c.logits_via_embedding}
  return out | {"boi_token_index": c.image_start_token_id, "eoi_token_index": c.image_end_token_id}


def rules(c: Any) -> list[Rule]:
  """The SigLIP tower (vision_tower.) and Gemma 3's projector, into layers/vision.VisionEncoder."""
  root = ("vision_encoder",)
  out = [
    Rule("vision_tower.embeddings.patch_embedding.weight", (*root, "patch_embedding", "kernel"), (), 3, conv=True),
    Rule("vision_tower.embeddings.patch_embedding.bias", (*root, "patch_embedding", "bias"), (), None),
    Rule("vision_tower.embeddings.position_embedding.weight", (*root, "position_embedding"), (), None),
    Rule("vision_tower.post_layernorm.weight", (*root, "post_layernorm", "scale"), (), None),
    Rule("vision_tower.post_layernorm.bias", (*root, "post_layernorm", "bias"), (), None),
    Rule("multi_modal_projector.mm_soft_emb_norm.weight", (*root, "mm_soft_emb_norm", "scale"), (), None),
    # [vision width, emb_dim]: already [in, out]
    Rule("multi_modal_projector.mm_input_projection_weight", (*root, "mm_input_projection", "kernel"), (), 1)._replace(
      transpose=False
    ),
  ]
  for i in range(c.num_hidden_layers_for_vit):
    hf = f"vision_tower.encoder.layers.{i}."
    ours, index = hf_mapping.tower_layer(c, root, i)
    for name, path, n_in in (
      ("self_attn.q_proj", "query", 1),
      ("self_attn.k_proj", "key", 1),
      ("self_attn.v_proj", "value", 1),
      ("self_attn.out_proj", "out", 2),
      ("mlp.fc1", "fc1", 1),
      ("mlp.fc2", "fc2", 1),
    ):
      out.append(Rule(f"{hf}{name}.weight", (*ours, path, "kernel"), index, n_in))
      out.append(Rule(f"{hf}{name}.bias", (*ours, path, "bias"), index, None))
    for norm in ("layer_norm1", "layer_norm2"):
      out.append(Rule(f"{hf}{norm}.weight", (*ours, norm, "scale"), index, None))
      out.append(Rule(f"{hf}{norm}.bias", (*ours, norm, "bias"), index, None))
  return out
