"""Mixtral <-> MixtralForCausalLM (model_type mixtral): Mistral's fields plus the experts; the experts' tensors
(block_sparse_moe.*) are the shared layout's MoE names."""

from __future__ import annotations

from MaxText.convert import hf_mapping


class Mixtral(hf_mapping.Mapping):
  decoder_block = "mixtral"
  model_types = ("mixtral",)
  arch = ("mixtral", "MixtralForCausalLM")
  biases = ()
  extra = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "router_aux_loss_coef": "load_balance_loss_weight",
  }


MAPPING = Mixtral()
