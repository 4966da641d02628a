"""Qwen3 <-> Qwen3ForCausalLM (model_type qwen3) and Qwen3-MoE <-> Qwen3MoeForCausalLM (qwen3_moe, when
num_experts > 1): Llama's layout with weighted q/k norms; the experts named mlp.gate, mlp.experts.E."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError

MOE = {  # qwen3_moe (transformers 5 writes num_local_experts, earlier versions num_experts)
  "num_experts": "num_experts",
  "num_local_experts": "num_experts",
  "num_experts_per_tok": "num_experts_per_tok",
  "moe_intermediate_size": "base_moe_mlp_dim",
  "norm_topk_prob": "norm_topk_prob",
  "router_aux_loss_coef": "load_balance_loss_weight",
}


class Qwen3(hf_mapping.Mapping):
  decoder_block = "qwen3"
  model_types = ("qwen3", "qwen3_moe")
  arch = ("qwen3", "Qwen3ForCausalLM")
  extra = MOE
  fixed = {"use_qk_norm": True}

  def check(self, hf: dict[str, Any]) -> None:
    if hf.get("model_type") == "qwen3_moe" and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
      raise ConfigError("qwen3_moe with decoder_sparse_step != 1 or mlp_only_layers is not supported")

  def export_arch(self, c) -> tuple[str, str, dict[str, Any], dict[str, str]]:
    if c.num_experts > 1:
      return "qwen3_moe", "Qwen3MoeForCausalLM", {}, self.extra
    return *self.arch, {}, {}

  def feed_forward_rules(self, c, moe: bool) -> Iterator[tuple]:
    return hf_mapping.routed_experts_rules(c) if moe else hf_mapping.mlp_rules(c, "mlp", ("mlp",))


MAPPING = Qwen3()
