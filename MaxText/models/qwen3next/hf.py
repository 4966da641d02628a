"""Qwen3-Next <-> Qwen3NextForCausalLM (model_type qwen3_next): Qwen3-MoE's fields plus the gated DeltaNet's
widths; layer_types must repeat full_attention_interval; one gated shared expert; partial RoPE. The DeltaNet
layers keep HF's fused tensors (linear_attn.*)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError
from MaxText.models.qwen3 import hf as qwen3_hf

EXTRA = {k: v for k, v in qwen3_hf.MOE.items() if k != "num_local_experts"}
EXTRA |= {
  "linear_num_key_heads": "linear_num_key_heads",
  "linear_num_value_heads": "linear_num_value_heads",
  "linear_key_head_dim": "linear_key_head_dim",
  "linear_value_head_dim": "linear_value_head_dim",
  "linear_conv_kernel_dim": "linear_conv_kernel_dim",
}
LINEAR_ATTENTION = (  # HF name under linear_attn., our path under self_attention, n_in
  ("in_proj_qkvz.weight", ("in_proj_qkvz", "kernel"), 1),
  ("in_proj_ba.weight", ("in_proj_ba", "kernel"), 1),
  ("conv1d.weight", ("conv1d",), None),
  ("dt_bias", ("dt_bias",), None),
  ("A_log", ("A_log",), None),
  ("norm.weight", ("norm", "scale"), None),
  ("out_proj.weight", ("out", "kernel"), 2),
)


def pattern_keys(hf: dict[str, Any]) -> dict[str, Any]:
  """The hybrid layer pattern (layer_types must repeat full_attention_interval) and the partial RoPE."""
  layers = hf["num_hidden_layers"]
  types = hf.get("layer_types") or []
  interval = types.index("full_attention") + 1 if "full_attention" in types else hf.get("full_attention_interval", 4)
  want = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
  if types and list(types) != want:
    raise ConfigError(f"qwen3_next layer_types={types} is not every {interval}th layer full attention; unsupported")
  rope = hf.get("rope_parameters") or {}
  factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  return {"full_attention_interval": interval, "partial_rotary_factor": factor}


def layer_keys(hf: dict[str, Any]) -> dict[str, Any]:
  """Qwen3-Next's layer pattern and partial RoPE (pattern_keys), and its shared expert."""
  keys = pattern_keys(hf)
  if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers") or not hf.get("num_experts"):
    raise ConfigError("qwen3_next without MoE in every layer (decoder_sparse_step, mlp_only_layers) is not supported")
  shared, width = hf.get("shared_expert_intermediate_size") or 0, hf["moe_intermediate_size"]
  if shared % width:
    raise ConfigError(f"qwen3_next shared_expert_intermediate_size={shared} is not a multiple of {width}")
  return keys | {"shared_experts": shared // width}


def layer_types(c) -> list[str]:
  """config.json layer_types of the hybrid stack: every full_attention_interval-th layer full attention."""
  interval = c.full_attention_interval
  return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(c.num_decoder_layers)]


class Qwen3Next(hf_mapping.Mapping):
  decoder_block = "qwen3next"
  model_types = ("qwen3_next",)
  arch = ("qwen3_next", "Qwen3NextForCausalLM")
  extra = EXTRA
  fixed = {"use_qk_norm": True, "shared_expert_gate": True}

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    return layer_keys(hf)

  def export_fields(self, c, out: dict[str, Any]) -> None:
    if not (c.shared_experts and c.shared_expert_gate and c.num_experts > 1):
      raise ConfigError(
        "qwen3_next export needs num_experts > 1 and one gated shared expert (shared_experts, shared_expert_gate)"
      )
    out["shared_expert_intermediate_size"] = c.shared_experts * c.moe_mlp_dim
    out["decoder_sparse_step"], out["mlp_only_layers"] = 1, []
    out["layer_types"] = layer_types(c)

  def export_rope(self, c) -> dict[str, Any]:
    return super().export_rope(c) | {"partial_rotary_factor": c.partial_rotary_factor}

  def is_linear(self, c, i: int) -> bool:
    return (i + 1) % c.full_attention_interval != 0  # models/qwen3next.is_full_attention

  def attention_rules(self, c, linear: bool) -> Iterator[tuple]:
    if not linear:
      yield from super().attention_rules(c, linear)
      return
    for hf, path, n_in in LINEAR_ATTENTION:  # layers/gated_deltanet.py keeps HF's fused layouts
      yield f"linear_attn.{hf}", ("self_attention", *path), (), n_in, None

  def feed_forward_rules(self, c, moe: bool) -> Iterator[tuple]:
    if not moe:
      yield from hf_mapping.mlp_rules(c, "mlp", ("mlp",))
      return
    yield from hf_mapping.routed_experts_rules(c, shared="mlp.shared_expert")
    if c.shared_experts:  # one shared expert, gated
      yield "mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), (), 1, None


MAPPING = Qwen3Next()
