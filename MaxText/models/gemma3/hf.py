"""Gemma 3 <-> Gemma3ForCausalLM (model_type gemma3_text): Gemma 2's layout plus weighted q/k norms, and two
RoPE bases (rope_parameters per attention type: full_attention, sliding_attention). With use_multimodal,
Gemma3ForConditionalGeneration (model_type gemma3): the text model under language_model. and the SigLIP tower
(hf_vision.py)."""

from __future__ import annotations

from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError
from MaxText.models.gemma2 import hf as gemma2_hf
from MaxText.models.gemma3 import hf_vision


class Gemma3(gemma2_hf.Gemma2):
  decoder_block = "gemma3"
  model_types = ("gemma3_text",)
  multimodal_type = "gemma3"  # Gemma3ForConditionalGeneration
  arch = ("gemma3_text", "Gemma3ForCausalLM")
  fixed = {"use_post_attn_norm": True, "use_post_ffw_norm": True, "use_qk_norm": True}

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("model_type") != self.multimodal_type:
      return super().maxtext_keys(hf)
    if "text_config" not in hf:
      raise ConfigError("model_type=gemma3 config.json needs a text_config object")
    text, vision = hf_vision.maxtext_keys(hf)
    return super().maxtext_keys(text) | {"use_multimodal": True} | vision

  def import_rope(self, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    out = hf_mapping.rope_keys(rope["full_attention"], "rope_max_timescale", hf)
    return out | {"local_rope_max_timescale": rope["sliding_attention"]["rope_theta"]}

  def export_rope(self, c) -> dict[str, Any]:
    local = hf_mapping.rope_parameters(c, "default", c.local_rope_max_timescale)
    return {"full_attention": super().export_rope(c), "sliding_attention": local}

  def export_multimodal(self, c, out: dict[str, Any], dtype: str) -> dict[str, Any]:
    return hf_vision.hf_config(c, out, dtype)

  def multimodal_rules(self, c, text: list[hf_mapping.Rule]) -> list[hf_mapping.Rule]:
    prefix = hf_mapping.TEXT_PREFIX
    text = [r._replace(hf_name=prefix + r.hf_name if r.hf_name.startswith("model.") else r.hf_name) for r in text]
    return text + hf_vision.rules(c)


MAPPING = Gemma3()
