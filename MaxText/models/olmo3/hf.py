"""OLMo 3 <-> Olmo3ForCausalLM (model_type olmo3): Llama's tensors without input_layernorm, with the norms after
each sublayer (post_attention_layernorm, post_feedforward_layernorm) and q/k norms over the flat projections
([heads * head_dim]); layer_types must be three sliding_attention layers per full_attention one; RoPE per
attention type (rope_parameters full_attention / sliding_attention, or a legacy rope_scaling: the full layers')."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError
from MaxText.models.olmo3 import SLIDING_PER_FULL

DEFAULT_THETA = 500000.0  # Olmo3Config's RoPE base when config.json gives none


def layer_types(layers: int) -> list[str]:
  period = SLIDING_PER_FULL + 1
  return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


class Olmo3(hf_mapping.Mapping):
  decoder_block = "olmo3"
  model_types = ("olmo3",)
  arch = ("olmo3", "Olmo3ForCausalLM")
  extra = {"sliding_window": "sliding_window_size"}
  fixed = {"use_qk_norm": True}

  def check(self, hf: dict[str, Any]) -> None:
    types = hf.get("layer_types")
    if types is not None and list(types) != layer_types(hf["num_hidden_layers"]):
      raise ConfigError(
        f"olmo3 layer_types={types} is not three sliding_attention layers per full_attention layer; unsupported"
      )
    if not hf.get("sliding_window"):
      raise ConfigError("olmo3 config.json needs a sliding_window for its sliding_attention layers")

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    return super().maxtext_keys({"rope_theta": DEFAULT_THETA, **hf})

  def import_rope(self, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    full = rope.get("full_attention") or rope  # legacy rope_theta + rope_scaling: the full layers' (Olmo3Config)
    sliding = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": full["rope_theta"]}
    if (sliding.get("rope_type") or "default") != "default":
      raise ConfigError(f"olmo3 sliding_attention rope_type {sliding['rope_type']!r} is not supported; only default")
    return hf_mapping.rope_keys(full, "rope_max_timescale", hf) | {"local_rope_max_timescale": sliding["rope_theta"]}

  def export_fields(self, c, out: dict[str, Any]) -> None:
    if c.num_experts > 1 or not c.use_qk_norm or c.sliding_window_size <= 0:
      raise ConfigError(
        "olmo3 export needs num_experts <= 1, use_qk_norm=true and sliding_window_size > 0 (Olmo3ForCausalLM's layers)"
      )
    out["layer_types"] = layer_types(c.num_decoder_layers)

  def export_rope(self, c) -> dict[str, Any]:
    local = hf_mapping.rope_parameters(c, "default", c.local_rope_max_timescale)
    return {"full_attention": super().export_rope(c), "sliding_attention": local}

  def norm_rules(self) -> Iterator[tuple]:
    yield "post_attention_layernorm.weight", ("post_self_attention_norm", "scale"), (), None, None
    yield "post_feedforward_layernorm.weight", ("post_ffw_norm", "scale"), (), None, None

  def layer_rules(self, c, moe: bool, linear: bool = False) -> Iterator[tuple]:
    """No input_layernorm: the norms follow the sublayers."""
    yield from self.attention_rules(c, linear)
    yield from self.norm_rules()
    yield from self.feed_forward_rules(c, moe)


MAPPING = Olmo3()
