"""Qwen3.5-MoE <-> Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text): Qwen3-Next's fields and layer pattern
(models/qwen3next/hf.py) with the DeltaNet's projections separate; the router always renormalises its top-k
(the config has no norm_topk_prob, decoder_sparse_step, mlp_only_layers or intermediate_size). The releases'
image-text checkpoints (Qwen3_5MoeForConditionalGeneration, qwen3_5_moe) import their text model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.errors import ConfigError
from MaxText.models.qwen3next import hf as qwen3next_hf

LINEAR_ATTENTION = (  # HF name under linear_attn., our path under self_attention, n_in
  ("in_proj_qkv.weight", ("in_proj_qkv", "kernel"), 1),
  ("in_proj_z.weight", ("in_proj_z", "kernel"), 1),
  ("in_proj_b.weight", ("in_proj_b", "kernel"), 1),
  ("in_proj_a.weight", ("in_proj_a", "kernel"), 1),
  ("conv1d.weight", ("conv1d",), None),
  ("dt_bias", ("dt_bias",), None),
  ("A_log", ("A_log",), None),
  ("norm.weight", ("norm", "scale"), None),
  ("out_proj.weight", ("out", "kernel"), 2),
)
ABSENT = ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")  # not Qwen3.5 fields


class Qwen35Moe(qwen3next_hf.Qwen3Next):
  decoder_block = "qwen3_5"
  model_types = ("qwen3_5_moe_text",)
  multimodal_type = "qwen3_5_moe"  # Qwen3_5MoeForConditionalGeneration (the releases): its text model is imported
  arch = ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
  extra = {k: v for k, v in qwen3next_hf.EXTRA.items() if k != "norm_topk_prob"}
  fixed = {**qwen3next_hf.Qwen3Next.fixed, "norm_topk_prob": True}
  required_fields = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_experts", "vocab_size")

  def check(self, hf: dict[str, Any]) -> None:
    if not hf.get("num_experts"):
      raise ConfigError("qwen3_5_moe_text config.json needs num_experts (every layer is MoE)")

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    """An image-text checkpoint (the releases) imports its text model: text_config's fields."""
    if hf.get("model_type") != self.multimodal_type:
      return super().maxtext_keys(hf)
    if not isinstance(hf.get("text_config"), dict):
      raise ConfigError("model_type=qwen3_5_moe config.json needs a text_config object")
    text = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"]}
    return super().maxtext_keys({**text, "model_type": self.model_types[0]})

  def ignored(self, c, hf_name: str) -> bool:
    """The releases' vision tower and multi-token-prediction layer (transformers' CausalLM skips them too)."""
    return hf_name.startswith(("model.visual.", "mtp."))

  def export_fields(self, c, out: dict[str, Any]) -> None:
    if not c.norm_topk_prob:
      raise ConfigError("qwen3_5_moe_text export needs norm_topk_prob=true (its router always renormalises)")
    super().export_fields(c, out)
    for field in ABSENT:
      out.pop(field, None)

  def attention_rules(self, c, linear: bool) -> Iterator[tuple]:
    if not linear:
      yield from super().attention_rules(c, linear)
      return
    for hf, path, n_in in LINEAR_ATTENTION:  # layers/gated_deltanet.SplitGatedDeltaNet keeps HF's layouts
      yield f"linear_attn.{hf}", ("self_attention", *path), (), n_in, None


MAPPING = Qwen35Moe()
