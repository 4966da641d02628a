"""MiniMax M2 <-> MiniMaxM2ForCausalLM (model_type minimax_m2): Mixtral's tensor names
(block_sparse_moe.gate, block_sparse_moe.experts.E.w1/w2/w3) plus the selection bias
(block_sparse_moe.e_score_correction_bias) and q/k norm weights over all heads ([N * H]); rotary_dim (or
rope_parameters' partial_rotary_factor) gives the partial RoPE. The published config.json's own fields
(scoring_func, use_routing_bias, qk_norm_type, attn_type_list, shared_intermediate_size) are checked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError

# The published config.json's fields that transformers' class ignores -> the value this architecture needs.
PUBLISHED = {
  "scoring_func": "sigmoid",
  "use_routing_bias": True,
  "use_qk_norm": True,
  "qk_norm_type": "per_layer",
  "shared_intermediate_size": 0,
}


class MiniMaxM2(hf_mapping.Mapping):
  decoder_block = "minimax_m2"
  model_types = ("minimax_m2",)
  arch = ("minimax_m2", "MiniMaxM2ForCausalLM")
  biases = ()
  extra = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "router_aux_loss_coef": "load_balance_loss_weight",
  }
  fixed = {"use_qk_norm": True, "routed_score_func": "sigmoid", "routed_bias": True, "norm_topk_prob": True}

  def check(self, hf: dict[str, Any]) -> None:
    for field, want in PUBLISHED.items():
      if field in hf and hf[field] != want:
        raise ConfigError(f"minimax_m2 config.json {field}={hf[field]!r} is not supported (only {want!r})")
    if any(kind != 1 for kind in hf.get("attn_type_list") or ()):
      raise ConfigError("minimax_m2 attn_type_list with lightning (linear) attention layers (0) is not supported")
    if (hf.get("num_local_experts") or 1) < 2:
      raise ConfigError("minimax_m2 needs num_local_experts > 1 (every layer is a MoE)")

  def import_rope(self, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    factor = rope.get("partial_rotary_factor") or (hf.get("rotary_dim") or head_dim) / head_dim
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    return super().import_rope(rope, hf) | {"partial_rotary_factor": factor}

  def export_fields(self, c, out: dict[str, Any]) -> None:
    got = (c.num_experts > 1, c.routed_score_func, c.routed_bias, c.norm_topk_prob, c.shared_experts, c.use_qk_norm)
    if got != (True, "sigmoid", True, True, 0, True) or c.first_num_dense_layers or c.routed_scaling_factor != 1:
      raise ConfigError(
        "minimax_m2 exports as MiniMaxM2ForCausalLM only with num_experts > 1, routed_score_func=sigmoid, "
        "routed_bias=true, norm_topk_prob=true, shared_experts=0, use_qk_norm=true, first_num_dense_layers=0, "
        f"routed_scaling_factor=1; got {c.num_experts}, {c.routed_score_func}, {c.routed_bias}, {c.norm_topk_prob}, "
        f"{c.shared_experts}, {c.use_qk_norm}, {c.first_num_dense_layers}, {c.routed_scaling_factor}"
      )
    out["rotary_dim"] = int(c.head_dim * c.partial_rotary_factor)

  def export_rope(self, c) -> dict[str, Any]:
    return super().export_rope(c) | {"partial_rotary_factor": c.partial_rotary_factor}

  def is_moe(self, c, i: int) -> bool:
    return True

  def feed_forward_rules(self, c, moe: bool) -> Iterator[tuple]:
    yield from super().feed_forward_rules(c, moe)
    yield "block_sparse_moe.e_score_correction_bias", ("mlp", "gate_bias"), (), None, None


MAPPING = MiniMaxM2()
