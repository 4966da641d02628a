"""Qwen3.5 <-> Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text) and the dense Qwen3_5ForCausalLM
(qwen3_5_text): Qwen3-Next's fields and layer pattern (models/qwen3next/hf.py) with the DeltaNet's projections
separate. MoE (num_experts > 1): the router always renormalises its top-k (the config has no norm_topk_prob,
decoder_sparse_step, mlp_only_layers or intermediate_size). Dense (num_experts 1): the same stack with a gated
MLP of intermediate_size in every layer and no MoE fields. The releases' image-text checkpoints
(Qwen3_5MoeForConditionalGeneration, qwen3_5_moe; Qwen3_5ForConditionalGeneration, qwen3_5) import their text
model."""

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
MOE_TYPE, DENSE_TYPE = "qwen3_5_moe_text", "qwen3_5_text"
IMAGE_TEXT = {"qwen3_5_moe": MOE_TYPE, "qwen3_5": DENSE_TYPE}  # the releases' model_type -> their text model's
DENSE_EXTRA = {k: v for k, v in qwen3next_hf.EXTRA.items() if k.startswith("linear_")}  # the DeltaNet's widths
MOE_ONLY = ("shared_expert_gate", "norm_topk_prob")  # the family's fixed keys that only the MoE has


class Qwen35(qwen3next_hf.Qwen3Next):
  decoder_block = "qwen3_5"
  model_types = (MOE_TYPE, DENSE_TYPE, "qwen3_5")
  multimodal_type = "qwen3_5_moe"  # Qwen3_5MoeForConditionalGeneration (the releases): its text model is imported
  arch = (MOE_TYPE, "Qwen3_5MoeForCausalLM")
  extra = {k: v for k, v in qwen3next_hf.EXTRA.items() if k != "norm_topk_prob"}
  fixed = {**qwen3next_hf.Qwen3Next.fixed, "norm_topk_prob": True}
  # and num_experts (MoE) or intermediate_size (dense): check()
  required_fields = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")

  def check(self, hf: dict[str, Any]) -> None:
    if hf.get("model_type") == DENSE_TYPE:
      moe = [k for k in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size") if hf.get(k)]
      if moe:
        raise ConfigError(
          f"qwen3_5_text (dense) config.json has MoE fields {', '.join(moe)}; a MoE checkpoint is qwen3_5_moe_text"
        )
      if not hf.get("intermediate_size"):
        raise ConfigError("qwen3_5_text config.json needs intermediate_size (the width of every layer's MLP)")
    elif not hf.get("num_experts"):
      raise ConfigError("qwen3_5_moe_text config.json needs num_experts (every layer is MoE)")

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    """An image-text checkpoint (the releases) imports its text model: text_config's fields."""
    model_type = hf.get("model_type")
    if model_type in IMAGE_TEXT:
      if not isinstance(hf.get("text_config"), dict):
        raise ConfigError(f"model_type={model_type} config.json needs a text_config object")
      hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"]}
      hf["model_type"] = IMAGE_TEXT[model_type]
    out = super().maxtext_keys(hf)
    if hf["model_type"] == DENSE_TYPE:
      for key in MOE_ONLY:
        out.pop(key)
    return out

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    if hf["model_type"] == DENSE_TYPE:
      return qwen3next_hf.pattern_keys(hf) | {"num_experts": 1}
    return super().family_keys(hf)

  def ignored(self, c, hf_name: str) -> bool:
    """The releases' vision tower and multi-token-prediction layer (transformers' CausalLM skips them too)."""
    return hf_name.startswith(("model.visual.", "mtp."))

  def export_arch(self, c) -> tuple[str, str, dict[str, Any], dict[str, str]]:
    if c.num_experts > 1:
      return super().export_arch(c)
    return DENSE_TYPE, "Qwen3_5ForCausalLM", {}, DENSE_EXTRA

  def export_fields(self, c, out: dict[str, Any]) -> None:
    if c.num_experts <= 1:  # dense: intermediate_size is the MLP's width
      out["layer_types"] = qwen3next_hf.layer_types(c)
      return
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


MAPPING = Qwen35()
