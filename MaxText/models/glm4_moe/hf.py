"""GLM-4.5 <-> Glm4MoeForCausalLM (model_type glm4_moe): Llama's attention tensors with q/k/v biases (attention_bias;
o_proj has none) and q_norm/k_norm when use_qk_norm, DeepSeek V3's router, experts and shared experts (mlp.gate,
mlp.experts.E, mlp.shared_experts), partial RoPE (partial_rotary_factor, transformers' default 0.5), and the
multi-token-prediction layers after the decoder's in DeepSeek V3's layout (read when mtp_num_layers asks)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError
from MaxText.models.deepseek import hf as deepseek_hf

MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
EXTRA = {k: v for k, v in deepseek_hf.EXTRA.items() if k not in MLA} | {"use_qk_norm": "use_qk_norm"}
ROUTER = {"routed_score_func": "sigmoid", "routed_bias": True, "routed_group_score": "top2_sum"}


def partial_rotary_factor(hf: dict[str, Any]) -> float:
  """transformers reads it from rope_parameters, else config.json's top level, else 0.5."""
  rope = hf.get("rope_parameters") or {}
  return rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))


class Glm4Moe(deepseek_hf.DeepSeek):
  decoder_block = "glm4_moe"
  model_types = ("glm4_moe",)
  arch = ("glm4_moe", "Glm4MoeForCausalLM")
  extra = EXTRA
  biases = ("attention_bias",)

  def check(self, hf: dict[str, Any]) -> None:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    factor = partial_rotary_factor(hf)
    if not 0 < factor <= 1 or int(head_dim * factor) % 2:
      raise ConfigError(
        f"glm4_moe partial_rotary_factor={factor} with head_dim={head_dim} does not give an even number of "
        "rotary dims in (0, head_dim]; RoPE rotates pairs of dims"
      )

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    return ROUTER | {"partial_rotary_factor": partial_rotary_factor(hf)}

  def export_arch(self, c) -> tuple[str, str, dict[str, Any], dict[str, str]]:
    got = {k: c[k] for k in ROUTER}
    if got != ROUTER:
      raise ConfigError(f"glm4_moe exports with {ROUTER} (Glm4MoeForCausalLM's router); got {got}")
    return *self.arch, {}, self.extra

  def export_rope(self, c) -> dict[str, Any]:
    return hf_mapping.Mapping.export_rope(self, c) | {"partial_rotary_factor": c.partial_rotary_factor}

  def qkv_rules(self, c) -> Iterator[tuple]:
    return hf_mapping.Mapping.qkv_rules(self, c)

  def attention_rules(self, c, linear: bool) -> Iterator[tuple]:
    """Llama's, less o_proj.bias (attention_bias biases q, k and v only)."""
    return (rule for rule in super().attention_rules(c, linear) if rule[0] != "self_attn.o_proj.bias")


MAPPING = Glm4Moe()
