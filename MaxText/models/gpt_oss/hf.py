"""gpt-oss <-> GptOssForCausalLM (model_type gpt_oss): layer_types must alternate sliding and full attention
from a sliding layer; sinks, a biased router and biased experts; the experts are fused with gate and up
columns interleaved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError


def check_layers(hf: dict[str, Any]) -> None:
  """gpt-oss's layer_types must alternate sliding and full attention from a sliding layer (models/gpt_oss)."""
  want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"])]
  if hf.get("layer_types") is not None and list(hf["layer_types"]) != want:
    raise ConfigError(f"gpt_oss layer_types={hf['layer_types']} do not alternate sliding/full; only that is supported")


class GptOss(hf_mapping.Mapping):
  decoder_block = "gpt_oss"
  model_types = ("gpt_oss",)
  arch = ("gpt_oss", "GptOssForCausalLM")
  extra = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "router_aux_loss_coef": "load_balance_loss_weight",
    "swiglu_limit": "mlp_activations_limit",
    "swiglu_alpha": "swiglu_alpha",
  }
  # sinks, biased router (softmax over the chosen logits) and biased experts
  fixed = {"attention_sink": True, "router_bias": True, "mlp_bias": True, "routed_score_func": "softmax"}
  fixed |= {"norm_topk_prob": True}

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    check_layers(hf)
    return {}

  def export_fields(self, c, out: dict[str, Any]) -> None:
    wrong = {k: c[k] for k, v in self.fixed.items() if c[k] != v}
    if wrong or c.moe_mlp_dim != c.mlp_dim or c.num_experts <= 1:
      raise ConfigError(f"gpt_oss fixes {self.fixed}, MoE layers and moe_mlp_dim = mlp_dim; got {wrong}")

  def feed_forward_rules(self, c, moe: bool) -> Iterator[tuple]:
    """gpt-oss keeps experts fused, [in, out] per expert like ours: gate_up_proj [E, D, 2F] with gate and up
    columns interleaved (gate even, up odd), its bias [E, 2F] likewise, down_proj [E, F, D] and its bias [E, D]."""
    yield "mlp.router.weight", ("mlp", "gate", "kernel"), (), 1, None
    yield "mlp.router.bias", ("mlp", "gate", "bias"), (), None, None
    for j, half in enumerate(("wi_0", "wi_1")):
      yield "mlp.experts.gate_up_proj", ("mlp", half), (), None, None, (j, None, 2)
      yield "mlp.experts.gate_up_proj_bias", ("mlp", f"{half}_bias"), (), None, None, (j, None, 2)
    yield "mlp.experts.down_proj", ("mlp", "wo"), (), None, None
    yield "mlp.experts.down_proj_bias", ("mlp", "wo_bias"), (), None, None


MAPPING = GptOss()
