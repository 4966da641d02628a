"""Gemma 4 <-> Gemma4ForCausalLM (model_type gemma4_text): Gemma 2's tensor layout (pre+post norms around both
sublayers) with q/k norms, each layer's `layer_scalar`, and full-attention layers (layer_types) whose head dim and
kv-head count come from per_layer_config (or global_head_dim / num_global_key_value_heads) and which, with
attention_k_eq_v, have no v_proj. The last num_kv_shared_layers layers have no k_proj, v_proj or k_norm (ignored
if a checkpoint holds them), and MLPs twice as wide under use_double_wide_mlp. Per-layer embeddings
(embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm; per layer per_layer_input_gate,
per_layer_projection, post_per_layer_input_norm) when hidden_size_per_layer_input > 0. RoPE per attention type:
"proportional" (or default) on full layers, default on sliding ones. enable_moe_block (our num_experts > 1): per layer
router.proj / router.scale / router.per_expert_scale, experts.gate_up_proj [E, 2F, D] (gate rows, then up) and
experts.down_proj [E, D, F] (each expert's torch Linear weights, transposed to ours), and the norms
post_feedforward_layernorm_1 (the dense MLP's), pre_ and post_feedforward_layernorm_2 (the experts'). The releases'
image-audio-text checkpoints (Gemma4ForConditionalGeneration, model_type gemma4) import their text model:
text_config, the tensors under model.language_model.; the vision and audio towers are skipped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.errors import ConfigError
from MaxText.models.gemma2 import hf as gemma2_hf

DEFAULT_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's when config.json gives neither per_layer_config nor global_head_dim
SHARED_KV = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm", "self_attn.v_norm")  # absent when sharing
DEFAULT_PERIOD = 6  # Gemma4TextConfig's layer_types when config.json has none: 5 sliding, then 1 full
DEFAULT_PER_LAYER, DEFAULT_PER_LAYER_VOCAB = 256, 262144  # Gemma4TextConfig's per-layer embedding width and rows
IMAGE_TEXT = "gemma4"  # Gemma4ForConditionalGeneration's model_type
# Its towers' tensor names (as hf_mapping.canonical_name writes them): skipped on import.
TOWERS = ("vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# Features of Gemma4TextConfig this project does not build yet: field -> (Gemma4TextConfig's default, the values
# that leave them off; the first is what an export writes).
UNSUPPORTED = {
  "use_bidirectional_attention": (None, (None, False, "vision")),  # "all": no causal mask ("vision": images only)
}


def layer_types(layers: int, period: int) -> list[str]:
  return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def period_of(hf: dict[str, Any]) -> int:
  """full_attention_interval from layer_types: every period-th layer full, the last one too (transformers forces
  it); ConfigError for any other pattern."""
  n = hf["num_hidden_layers"]
  types = list(hf.get("layer_types") or layer_types(n, DEFAULT_PERIOD))
  types[-1] = "full_attention"
  period = types.index("full_attention") + 1
  if types != layer_types(n, period) or n % period:
    raise ConfigError(
      f"gemma4 layer_types={types} is not (period - 1) sliding_attention layers then one full_attention layer, "
      "repeated over all layers; unsupported"
    )
  return period


def global_shape(hf: dict[str, Any]) -> tuple[int, int]:
  """(head dim, kv heads) of the full-attention layers, as Gemma4TextConfig resolves them."""
  head_dim, kv = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"], hf["num_key_value_heads"]
  per_layer = hf.get("per_layer_config")
  if per_layer is None:
    global_kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
    return hf.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM), global_kv or kv
  period = period_of(hf)
  full = {i for i in range(hf["num_hidden_layers"]) if (i + 1) % period == 0}
  overrides = {int(i): dict(v) for i, v in per_layer.items()}
  shapes = {(v.get("head_dim", head_dim), v.get("num_key_value_heads", kv)) for v in overrides.values()}
  if set(overrides) != full or len(shapes) != 1:
    raise ConfigError(f"gemma4 per_layer_config={per_layer} must give every full_attention layer the same shape")
  return shapes.pop()


class Gemma4(gemma2_hf.Gemma2):
  decoder_block = "gemma4"
  model_types = ("gemma4_text",)
  multimodal_type = IMAGE_TEXT  # the releases: their text model is imported, the towers skipped (TOWERS)
  towers = TOWERS
  arch = ("gemma4_text", "Gemma4ForCausalLM")
  extra = {"sliding_window": "sliding_window_size", "final_logit_softcapping": "final_logits_soft_cap"}
  fixed = {"use_post_attn_norm": True, "use_post_ffw_norm": True, "use_qk_norm": True}

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma4ForConditionalGeneration config.json (the releases) reads as its text model (text_config; the
    image-text class ties its head unless its own tie_word_embeddings says otherwise)."""
    if hf.get("model_type") == IMAGE_TEXT:
      hf = hf_mapping.text_model(hf, self.model_types[0], tie_default=True)
    return super().maxtext_keys(hf)

  def check(self, hf: dict[str, Any]) -> None:
    for field, (default, off) in UNSUPPORTED.items():
      value = hf.get(field, default)
      if value not in off:
        raise ConfigError(f"gemma4 config.json {field}={value!r} is not supported yet; set {off[0]!r}")
    shared, period = hf.get("num_kv_shared_layers") or 0, period_of(hf)
    first = hf["num_hidden_layers"] - shared
    if shared and (first < period or first % period):
      raise ConfigError(
        f"gemma4 num_kv_shared_layers={shared} must leave a positive multiple of the layer_types period {period} "
        "layers before it; unsupported"
      )

  def moe_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE block's keys: softmax top-k renormalised (the per-expert scale and router norm are implied)."""
    if not hf.get("enable_moe_block"):
      return {"num_experts": 1}
    missing = [f for f in ("num_experts", "top_k_experts", "moe_intermediate_size") if not hf.get(f)]
    if missing:
      raise ConfigError(f"gemma4 config.json with enable_moe_block=true needs {', '.join(missing)}")
    out = {"num_experts": hf["num_experts"], "num_experts_per_tok": hf["top_k_experts"]}
    out |= {"base_moe_mlp_dim": hf["moe_intermediate_size"], "routed_score_func": "softmax", "norm_topk_prob": True}
    return out | {"shared_experts": 0, "routed_bias": False, "routed_scaling_factor": 1.0}

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    head_dim, kv = global_shape(hf)
    k_eq_v = bool(hf.get("attention_k_eq_v"))
    out = {"global_head_dim": head_dim, "global_num_kv_heads": kv, "attention_k_eq_v": k_eq_v}
    out |= {"num_kv_shared_layers": hf.get("num_kv_shared_layers") or 0}
    out |= {"hidden_size_per_layer_input": hf.get("hidden_size_per_layer_input", DEFAULT_PER_LAYER) or 0}
    out |= {"vocab_size_per_layer_input": hf.get("vocab_size_per_layer_input") or DEFAULT_PER_LAYER_VOCAB}
    out |= {"use_double_wide_mlp": bool(hf.get("use_double_wide_mlp")) and bool(hf.get("num_kv_shared_layers"))}
    return out | {"full_attention_interval": period_of(hf)} | self.moe_keys(hf)

  def import_rope(self, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    full = rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    full = {"rope_theta": 1000000.0, **full}
    sliding = {"rope_type": "default", "rope_theta": 10000.0, **(rope.get("sliding_attention") or {})}
    if sliding["rope_type"] != "default":
      raise ConfigError(f"gemma4 sliding_attention rope_type {sliding['rope_type']!r} is not supported; only default")
    local = {"local_rope_max_timescale": sliding["rope_theta"]}
    if full.get("rope_type") != "proportional":
      return hf_mapping.rope_keys(full, "rope_max_timescale", hf) | local
    if full.get("factor", 1.0) != 1.0:
      raise ConfigError(f"gemma4 proportional RoPE factor={full['factor']} is not supported; only 1.0")
    out = {"rope_max_timescale": full["rope_theta"], "rope_type": "proportional"}
    return out | {"partial_rotary_factor": full.get("partial_rotary_factor", 1.0)} | local

  def export_rope(self, c) -> dict[str, Any]:
    local = hf_mapping.rope_parameters(c, "default", c.local_rope_max_timescale)
    if c.rope_type != "proportional":
      return {"full_attention": super().export_rope(c), "sliding_attention": local}
    full = {"rope_type": "proportional", "rope_theta": float(c.rope_max_timescale)}
    return {"full_attention": full | {"partial_rotary_factor": c.partial_rotary_factor}, "sliding_attention": local}

  def export_fields(self, c, out: dict[str, Any]) -> None:
    period, n = c.full_attention_interval, c.num_decoder_layers
    if n % period:
      raise ConfigError(
        f"gemma4 export needs num_decoder_layers ({n}) a multiple of full_attention_interval ({period}): "
        "transformers makes the last layer full attention"
      )
    moe = c.num_experts > 1
    if moe and (c.shared_experts or c.routed_score_func != "softmax" or not c.norm_topk_prob or c.routed_bias):
      raise ConfigError(
        "gemma4 MoE export needs shared_experts=0, routed_score_func=softmax, norm_topk_prob=true, "
        "routed_bias=false (transformers' Gemma4TextRouter)"
      )
    out["enable_moe_block"] = moe
    if moe:
      out |= {"num_experts": c.num_experts, "top_k_experts": c.num_experts_per_tok}
      out["moe_intermediate_size"] = c.moe_mlp_dim
    head_dim, kv = c.global_head_dim or c.head_dim, c.global_num_kv_heads or c.num_kv_heads
    out["layer_types"] = layer_types(n, period)
    out["per_layer_config"] = {
      str(i): {"head_dim": head_dim, "num_key_value_heads": kv} for i in range(n) if (i + 1) % period == 0
    }
    out["attention_k_eq_v"] = c.attention_k_eq_v
    out["num_kv_shared_layers"], out["use_double_wide_mlp"] = c.num_kv_shared_layers, c.use_double_wide_mlp
    out["hidden_size_per_layer_input"] = c.hidden_size_per_layer_input
    out["vocab_size_per_layer_input"] = c.vocab_size_per_layer_input
    out |= {field: off[0] for field, (_, off) in UNSUPPORTED.items() if off[0] is not None}

  def gemma4_layer_rules(self, c, full: bool, shares_kv: bool) -> Iterator[tuple]:
    yield "input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), (), None, None
    absent = SHARED_KV if shares_kv else ("self_attn.v_proj",) if full and c.attention_k_eq_v else ()
    for suffix, path, *rest in self.attention_rules(c, False):
      if not suffix.startswith(absent):
        yield suffix, path, *rest
    yield from self.norm_rules()
    yield from self.feed_forward_rules(c, False)
    if c.num_experts > 1:
      yield from self.moe_rules(c)
    if c.hidden_size_per_layer_input:
      yield "per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"), (), 1, None
      yield "per_layer_projection.weight", ("per_layer_projection", "kernel"), (), 1, None
      yield "post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "scale"), (), None, None
    yield "layer_scalar", ("layer_scalar",), (), None, None

  def moe_rules(self, c) -> Iterator[tuple]:
    """The MoE branch (Gemma4MoE at `moe`), beside the dense MLP."""
    f, moe = c.moe_mlp_dim, ("moe", "experts")
    yield "router.proj.weight", (*moe, "gate", "kernel"), (), 1, None
    yield "router.scale", ("moe", "router_norm", "scale"), (), None, None
    yield "router.per_expert_scale", (*moe, "per_expert_scale"), (), None, None
    yield "experts.gate_up_proj", (*moe, "wi_0"), (), None, None, {"rows": (0, f), "stacked": True}
    yield "experts.gate_up_proj", (*moe, "wi_1"), (), None, None, {"rows": (f, 2 * f), "stacked": True}
    yield "experts.down_proj", (*moe, "wo"), (), None, None, {"stacked": True}
    yield "post_feedforward_layernorm_1.weight", ("post_mlp_norm", "scale"), (), None, None
    yield "pre_feedforward_layernorm_2.weight", ("moe", "pre_norm", "scale"), (), None, None
    yield "post_feedforward_layernorm_2.weight", ("moe", "post_norm", "scale"), (), None, None

  def rules(self, c, stacks, params: dict) -> list[hf_mapping.Rule]:
    out = [hf_mapping.Rule("model.embed_tokens.weight", ("token_embedder", "embedding"), (), None)]
    out.append(hf_mapping.Rule("model.norm.weight", ("decoder_norm", "scale"), (), None))
    if not c.logits_via_embedding:
      out.append(hf_mapping.Rule("lm_head.weight", ("logits_dense", "kernel"), (), 1))
    if c.hidden_size_per_layer_input:
      ple = ("per_layer_inputs",)
      out.append(hf_mapping.Rule("model.embed_tokens_per_layer.weight", (*ple, "embedder", "embedding"), (), None))
      out.append(hf_mapping.Rule("model.per_layer_model_projection.weight", (*ple, "projection", "kernel"), (), 1))
      out.append(hf_mapping.Rule("model.per_layer_projection_norm.weight", (*ple, "norm", "scale"), (), None))
    for i, (prefix, index) in enumerate(hf_mapping.layer_locations(c, stacks, params)):
      full, shares_kv = (i + 1) % c.full_attention_interval == 0, self.shares_kv(c, i)
      out += hf_mapping.as_rules(f"model.layers.{i}", prefix, index, self.gemma4_layer_rules(c, full, shares_kv))
    return out

  def shares_kv(self, c, i: int) -> bool:
    return i >= c.num_decoder_layers - c.num_kv_shared_layers

  def ignored(self, c, hf_name: str) -> bool:
    """A kv-sharing layer's own k_proj, v_proj, k_norm (transformers also ignores them on load)."""
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 4 or not parts[2].isdigit():
      return False
    return self.shares_kv(c, int(parts[2])) and ".".join(parts[3:]).startswith(SHARED_KV)


MAPPING = Gemma4()
