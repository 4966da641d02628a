"""Llama 4 <-> Llama4ForCausalLM (model_type llama4_text): the per-layer lists of config.json (no_rope_layers,
moe_layers, layer_types) must follow the two intervals we keep; q/k rotate interleaved pairs (reordered into
our halves layout) and their norms have no weights; the experts are fused (copied in column ranges). With
use_multimodal, Llama4ForConditionalGeneration (model_type llama4): the text model under language_model. and
the vision tower (hf_vision.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError
from MaxText.models.llama4 import hf_vision


def check_layers(hf: dict[str, Any]) -> None:
  """Llama 4's per-layer lists must follow the intervals we keep (no_rope_layer_interval,
  interleave_moe_layer_step), as transformers derives them by default."""
  layers, nope = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
  step = hf.get("interleave_moe_layer_step", 1)
  expected = {
    "no_rope_layers": [int((i + 1) % nope != 0) for i in range(layers)],
    "moe_layers": list(range(step - 1, layers, step)),
    "layer_types": ["chunked_attention" if (i + 1) % nope else "full_attention" for i in range(layers)],
  }
  for key, want in expected.items():
    if hf.get(key) is not None and list(hf[key]) != want:
      raise ConfigError(
        f"llama4_text {key}={hf[key]} is not the pattern of no_rope_layer_interval={nope} and "
        f"interleave_moe_layer_step={step}; only those patterns are supported"
      )


class Llama4(hf_mapping.Mapping):
  decoder_block = "llama4"
  model_types = ("llama4_text",)
  multimodal_type = "llama4"  # Llama4ForConditionalGeneration
  arch = ("llama4_text", "Llama4ForCausalLM")
  extra = {  # routed experts are intermediate_size wide, dense layers intermediate_size_mlp
    "intermediate_size": "base_moe_mlp_dim",
    "intermediate_size_mlp": "base_mlp_dim",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "interleave_moe_layer_step": "interleave_moe_layer_step",
    "no_rope_layer_interval": "nope_layer_interval",
    "attention_chunk_size": "chunk_attn_window_size",
    "use_qk_norm": "use_qk_norm",
    "attn_temperature_tuning": "temperature_tuning",
    "floor_scale": "temperature_tuning_floor_scale",
    "attn_scale": "temperature_tuning_scale",
  }
  # top-1 sigmoid of the chosen logit, weighting the expert input; one shared expert of the experts' width
  fixed = {"routed_score_func": "sigmoid", "norm_topk_prob": False, "shared_experts": 1, "routed_weight_on_input": True}
  qk_norm_weights = False

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("model_type") != self.multimodal_type:
      return super().maxtext_keys(hf)
    text, vision = hf_vision.maxtext_keys(hf)  # the text decoder plus the vision tower
    return {**super().maxtext_keys(text), **vision}

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    check_layers(hf)
    return {}

  def hf_config(self, c, dtype: str) -> dict[str, Any]:
    if c.use_multimodal:
      return hf_vision.hf_config(c, super().hf_config(c.replace(use_multimodal=False), dtype), dtype)
    return super().hf_config(c, dtype)

  def export_fields(self, c, out: dict[str, Any]) -> None:
    wrong = {k: c[k] for k, v in self.fixed.items() if c[k] != v}
    if wrong:
      raise ConfigError(f"llama4_text fixes {self.fixed}; this config has {wrong}, which it cannot represent")
    out["intermediate_size"], out["intermediate_size_mlp"] = c.moe_mlp_dim, c.mlp_dim
    out["floor_scale"] = int(out["floor_scale"])

  def qk_perm(self, c) -> list[int]:
    return hf_mapping.deinterleave(0, c.head_dim)  # complex RoPE: interleaved pairs

  def is_moe(self, c, i: int) -> bool:
    return c.num_experts > 1 and (i + 1) % c.interleave_moe_layer_step == 0  # models/llama4.is_moe_layer

  def feed_forward_rules(self, c, moe: bool) -> Iterator[tuple]:
    """Llama 4 keeps experts fused: gate_up_proj [E, D, 2F] (gate columns, then up) and down_proj [E, F, D],
    both [in, out] per expert like ours, so they are copied (cut into column ranges) and not transposed."""
    if not moe:
      yield from hf_mapping.mlp_rules(c, "feed_forward", ("mlp",))
      return
    f = c.moe_mlp_dim
    yield "feed_forward.router.weight", ("mlp", "gate", "kernel"), (), 1, None
    yield "feed_forward.experts.gate_up_proj", ("mlp", "wi_0"), (), None, None, (0, f)
    yield "feed_forward.experts.gate_up_proj", ("mlp", "wi_1"), (), None, None, (f, 2 * f)
    yield "feed_forward.experts.down_proj", ("mlp", "wo"), (), None, None
    yield from hf_mapping.mlp_rules(c, "feed_forward.shared_expert", ("mlp", "shared_experts"))

  def multimodal_rules(self, c, text: list[hf_mapping.Rule]) -> list[hf_mapping.Rule]:
    text = [r._replace(hf_name=hf_mapping.TEXT_PREFIX + r.hf_name) for r in text]
    return text + [hf_mapping.Rule(name, path, index, n_in) for name, path, index, n_in in hf_vision.rules(c)]


MAPPING = Llama4()
