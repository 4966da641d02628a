"""Which Hugging Face config field and tensor corresponds to which MaxText key and parameter.

Tensor rule: HF name -> (MaxText parameter path, index prefix, n_in). A HF linear weight [out, in] is
the transpose of our kernel reshaped (n_in = how many leading kernel dims are inputs); n_in None means
the tensor is copied as is (norms, embeddings), or flattened (biases). The index prefix selects a slice of a stacked
parameter: the layer (scan_layers=true) and/or the expert.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from typing import Any, NamedTuple

from MaxText.config import Config
from MaxText.convert import fp8, gpt2_mapping, llama4_vision_mapping
from MaxText.errors import ConfigError

# HF model_type -> decoder_block, and back (with the HF architecture class).
DECODER_BLOCK = {
  "llama": "llama2",
  "mistral": "mistral",
  "mixtral": "mixtral",
  "qwen3": "qwen3",
  "qwen3_moe": "qwen3",
  "gemma": "gemma",
  "gemma2": "gemma2",
  "gemma3_text": "gemma3",
  "deepseek_v2": "deepseek",
  "deepseek_v3": "deepseek",
  "kimi_k2": "deepseek",  # Kimi K2: DeepseekV3ForCausalLM under its own (remote-code) config class
  "llama4_text": "llama4",
  "gpt_oss": "gpt_oss",
  "qwen3_next": "qwen3next",
}
HF_ARCH = {
  "llama2": ("llama", "LlamaForCausalLM"),
  "mistral": ("mistral", "MistralForCausalLM"),
  "mixtral": ("mixtral", "MixtralForCausalLM"),
  "qwen3": ("qwen3", "Qwen3ForCausalLM"),
  "gemma": ("gemma", "GemmaForCausalLM"),
  "gemma2": ("gemma2", "Gemma2ForCausalLM"),
  "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
  "deepseek": ("deepseek_v3", "DeepseekV3ForCausalLM"),  # deepseek_v2 for softmax routing (_deepseek_arch)
  "gpt3": ("gpt2", "GPT2LMHeadModel"),
  "llama4": ("llama4_text", "Llama4ForCausalLM"),
  "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
  "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
}
# HF field -> MaxText key, the same for every family.
COMMON = {
  "hidden_size": "base_emb_dim",
  "num_attention_heads": "base_num_query_heads",
  "num_key_value_heads": "base_num_kv_heads",
  "intermediate_size": "base_mlp_dim",
  "num_hidden_layers": "base_num_decoder_layers",
  "head_dim": "head_dim",
  "vocab_size": "vocab_size",
  "rms_norm_eps": "normalization_layer_epsilon",
  "tie_word_embeddings": "logits_via_embedding",
}
ACTIVATIONS = {"silu": ["silu", "linear"], "gelu_pytorch_tanh": ["gelu", "linear"], "gelu": ["gelu_exact", "linear"]}
GEMMA_EXTRA = {
  "sliding_window": "sliding_window_size",
  "query_pre_attn_scalar": "query_pre_attn_scalar",
  "attn_logit_softcapping": "attn_logits_soft_cap",
  "final_logit_softcapping": "final_logits_soft_cap",
}
EXTRA = {  # decoder_block -> {HF field: MaxText key}
  "mistral": {"sliding_window": "sliding_window_size"},
  "mixtral": {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "router_aux_loss_coef": "load_balance_loss_weight",
  },
  "gemma2": GEMMA_EXTRA,
  "gemma3": GEMMA_EXTRA,
  "qwen3": {  # qwen3_moe (transformers 5 writes num_local_experts, earlier versions num_experts)
    "num_experts": "num_experts",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "base_moe_mlp_dim",
    "norm_topk_prob": "norm_topk_prob",
    "router_aux_loss_coef": "load_balance_loss_weight",
  },
  "deepseek": {
    "moe_intermediate_size": "base_moe_mlp_dim",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "n_shared_experts": "shared_experts",
    "first_k_dense_replace": "first_num_dense_layers",
    "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
    "n_group": "n_routing_groups",
    "topk_group": "topk_routing_group",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
  },
  "llama4": {  # routed experts are intermediate_size wide, dense layers intermediate_size_mlp
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
  },
  "gpt_oss": {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "router_aux_loss_coef": "load_balance_loss_weight",
    "swiglu_limit": "mlp_activations_limit",
    "swiglu_alpha": "swiglu_alpha",
  },
}
EXTRA["qwen3next"] = {
  **{k: v for k, v in EXTRA["qwen3"].items() if k != "num_local_experts"},
  "linear_num_key_heads": "linear_num_key_heads",
  "linear_num_value_heads": "linear_num_value_heads",
  "linear_key_head_dim": "linear_key_head_dim",
  "linear_value_head_dim": "linear_value_head_dim",
  "linear_conv_kernel_dim": "linear_conv_kernel_dim",
}
FIXED = {  # decoder_block -> MaxText keys implied by the family
  "qwen3": {"use_qk_norm": True},
  "gemma2": {"use_post_attn_norm": True, "use_post_ffw_norm": True},
  "gemma3": {"use_post_attn_norm": True, "use_post_ffw_norm": True, "use_qk_norm": True},
  # top-1 sigmoid of the chosen logit, weighting the expert input; one shared expert of the experts' width
  "qwen3next": {"use_qk_norm": True, "shared_expert_gate": True},
  "llama4": {"routed_score_func": "sigmoid", "norm_topk_prob": False, "shared_experts": 1}
  | {"routed_weight_on_input": True},
  # sinks, biased router (softmax over the chosen logits) and biased experts
  "gpt_oss": {"attention_sink": True, "router_bias": True, "mlp_bias": True, "routed_score_func": "softmax"}
  | {"norm_topk_prob": True},
}
BIASES = {  # decoder_block -> the bias flags (HF field = MaxText key) of its transformers class
  "llama2": ("attention_bias", "mlp_bias"),
  **{block: ("attention_bias",) for block in ("qwen3", "gemma", "gemma2", "gemma3", "llama4", "gpt_oss", "qwen3next")},
}
ORIGINAL = {"original_max_position_embeddings": "original_max_position_embeddings"}
ROPE_KEYS = {  # rope_type -> {rope_parameters field: MaxText key}
  "default": {},
  "linear": {"factor": "rope_factor"},
  "llama3": {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor"}
  | {"high_freq_factor": "rope_high_freq_factor", **ORIGINAL},
  "yarn": {"factor": "rope_factor", **ORIGINAL, "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow"}
  | {"mscale": "rope_mscale", "mscale_all_dim": "rope_mscale_all_dim", "attention_factor": "rope_attention_factor"}
  | {"truncate": "rope_truncate"},
}
UNSET_IS_ZERO = ("rope_mscale", "rope_mscale_all_dim", "rope_attention_factor")  # absent from config.json when 0


def _rope_keys(params: dict[str, Any], theta_key: str, hf: dict[str, Any]) -> dict[str, Any]:
  """rope_parameters (or a legacy rope_scaling with `type`) -> MaxText keys; the pre-training length
  comes from where transformers takes it (top-level original_max_position_embeddings first)."""
  rope_type = params.get("rope_type") or params.get("type") or "default"
  if rope_type not in ROPE_KEYS:
    raise ConfigError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_KEYS)})")
  if "original_max_position_embeddings" in ROPE_KEYS[rope_type]:
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    params = {**params, "original_max_position_embeddings": original or hf.get("max_position_embeddings")}
  if rope_type == "yarn" and params.get("factor") is None:  # transformers: the ratio of the lengths
    params = {**params, "factor": hf["max_position_embeddings"] / params["original_max_position_embeddings"]}
  out = {theta_key: params["rope_theta"], "rope_type": rope_type}
  for src, dst in ROPE_KEYS[rope_type].items():
    if params.get(src) is not None:
      out[dst] = params[src]
  return out


def _rope_parameters(c: Config, rope_type: str, theta: float) -> dict[str, Any]:
  """MaxText keys -> rope_parameters of one attention type (the inverse of _rope_keys)."""
  out = {"rope_type": rope_type, "rope_theta": float(theta)}
  for hf, mt in ROPE_KEYS[rope_type].items():
    if c[mt] or mt not in UNSET_IS_ZERO:
      out[hf] = c[mt]
  return out


def _deepseek_routing(hf: dict[str, Any]) -> dict[str, Any]:
  """DeepSeek's router as transformers runs it: V3 sigmoid scores with a selection bias, groups ranked
  by the sum of their two best experts; V2 softmax scores, no bias, no renormalisation, topk_method
  greedy (no groups) or group_limited_greedy (groups ranked by their best expert)."""
  if hf["model_type"] in ("deepseek_v3", "kimi_k2"):
    return {"routed_score_func": "sigmoid", "routed_bias": True, "routed_group_score": "top2_sum"}
  method = hf.get("topk_method") or "greedy"
  if method not in ("greedy", "group_limited_greedy"):
    raise ConfigError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
  if hf.get("norm_topk_prob"):
    raise ConfigError("deepseek_v2 norm_topk_prob=true is not supported: transformers' DeepseekV2 never renormalises")
  out = {"routed_score_func": "softmax", "routed_bias": False, "routed_group_score": "max", "norm_topk_prob": False}
  return out | ({"n_routing_groups": 1, "topk_routing_group": 1} if method == "greedy" else {})


def _deepseek_arch(c: Config) -> tuple[str, str, dict[str, Any]]:
  """(model_type, architecture, extra config.json fields) of a deepseek config: the router decides."""
  grouped = c.n_routing_groups > 1
  if c.routed_score_func == "sigmoid" and c.routed_bias and not (grouped and c.routed_group_score != "top2_sum"):
    return "deepseek_v3", "DeepseekV3ForCausalLM", {"rope_interleave": True}  # the rules re-interleave rope dims
  if c.routed_score_func == "softmax" and not c.routed_bias and not c.norm_topk_prob:
    if not grouped or c.routed_group_score == "max":
      return "deepseek_v2", "DeepseekV2ForCausalLM", {"topk_method": "group_limited_greedy" if grouped else "greedy"}
  raise ConfigError(
    "deepseek exports as deepseek_v3 (routed_score_func=sigmoid, routed_bias=true, routed_group_score=top2_sum) "
    "or deepseek_v2 (routed_score_func=softmax, routed_bias=false, norm_topk_prob=false, routed_group_score=max); "
    f"got {c.routed_score_func}, routed_bias={c.routed_bias}, norm_topk_prob={c.norm_topk_prob}, "
    f"routed_group_score={c.routed_group_score}"
  )


def _check_llama4_layers(hf: dict[str, Any]) -> None:
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


def _check_gpt_oss_layers(hf: dict[str, Any]) -> None:
  """gpt-oss's layer_types must alternate sliding and full attention from a sliding layer (models/gpt_oss.py)."""
  want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"])]
  if hf.get("layer_types") is not None and list(hf["layer_types"]) != want:
    raise ConfigError(f"gpt_oss layer_types={hf['layer_types']} do not alternate sliding/full; only that is supported")


def _qwen3_next_keys(hf: dict[str, Any]) -> dict[str, Any]:
  """Qwen3-Next's layer pattern (layer_types must repeat full_attention_interval), shared expert, partial RoPE."""
  layers = hf["num_hidden_layers"]
  types = hf.get("layer_types") or []
  interval = types.index("full_attention") + 1 if "full_attention" in types else hf.get("full_attention_interval", 4)
  want = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
  if types and list(types) != want:
    raise ConfigError(f"qwen3_next layer_types={types} is not every {interval}th layer full attention; unsupported")
  if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers") or not hf.get("num_experts"):
    raise ConfigError("qwen3_next without MoE in every layer (decoder_sparse_step, mlp_only_layers) is not supported")
  shared, width = hf.get("shared_expert_intermediate_size") or 0, hf["moe_intermediate_size"]
  if shared % width:
    raise ConfigError(f"qwen3_next shared_expert_intermediate_size={shared} is not a multiple of {width}")
  rope = hf.get("rope_parameters") or {}
  factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  return {"full_attention_interval": interval, "shared_experts": shared // width, "partial_rotary_factor": factor}


# Gemma3ForConditionalGeneration (model_type gemma3): vision_config field -> MaxText key.
VISION_KEYS = {**llama4_vision_mapping.TOWER_KEYS, "layer_norm_eps": "vision_layer_norm_epsilon"}
VISION_DEFAULTS = {"num_channels": 3, "layer_norm_eps": 1e-6}
TEXT_PREFIX = "language_model."  # Gemma 3's multimodal checkpoints: language_model.model.layers..., vision_tower...
# Names other writers use for the same tensors (Google's releases, transformers' in-memory names) -> ours.
ALIASES = (("vision_tower.vision_model.", "vision_tower."), ("model.language_model.", "language_model.model."))
ALIASES += (("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))


def canonical_name(name: str) -> str:
  """A multimodal checkpoint's tensor name in the layout the rules use (the first alias that matches)."""
  for other, ours in ALIASES:
    if name.startswith(other):
      name = ours + name[len(other) :]
  return name


def _gemma3_multimodal_keys(hf: dict[str, Any]) -> dict[str, Any]:
  """Gemma3ForConditionalGeneration's config.json -> MaxText keys: its text_config's, plus the vision tower's."""
  vision = {**VISION_DEFAULTS, **hf["vision_config"]}
  if vision.get("vision_use_head"):
    raise ConfigError("vision_config.vision_use_head=true is not supported (Gemma 3 uses the patch outputs)")
  text = {"model_type": "gemma3_text", **hf["text_config"]}
  text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
  out = maxtext_keys(text) | {"use_multimodal": True}
  out |= {dst: vision[src] for src, dst in VISION_KEYS.items()}
  out["mm_tokens_per_image"] = hf.get("mm_tokens_per_image", 256)
  out["image_token_id"] = hf.get("image_token_index", hf.get("image_token_id", 262144))
  out["image_start_token_id"] = hf.get("boi_token_index", hf.get("boi_token_id", 255999))
  out["image_end_token_id"] = hf.get("eoi_token_index", hf.get("eoi_token_id", 256000))
  return out


def maxtext_keys(hf: dict[str, Any]) -> dict[str, Any]:
  """config.json -> the MaxText architecture keys; errors name what cannot be represented."""
  model_type = hf.get("model_type")
  if model_type == "gemma3" and "text_config" in hf:
    return _gemma3_multimodal_keys(hf)
  if model_type == "gpt2":
    return gpt2_mapping.maxtext_keys(hf)
  if model_type == "llama4":  # Llama4ForConditionalGeneration: the text decoder plus the vision tower
    text, vision = llama4_vision_mapping.maxtext_keys(hf)
    return {**maxtext_keys(text), **vision}
  if model_type not in DECODER_BLOCK:
    raise ConfigError(
      f"Unsupported architecture model_type={model_type!r}; supported: {', '.join(DECODER_BLOCK)}, gpt2"
    )
  block = DECODER_BLOCK[model_type]
  if block == "deepseek" and not hf.get("rope_interleave", True):
    raise ConfigError("config.json rope_interleave=false is not supported for deepseek_v3")
  if model_type == "qwen3_moe" and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
    raise ConfigError("qwen3_moe with decoder_sparse_step != 1 or mlp_only_layers is not supported")
  fp8.block_size(hf)  # FP8 block-scaled weights are dequantized on import; other quantizations fail here
  for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
    if hf.get(flag) and flag not in BIASES.get(block, ()):
      raise ConfigError(f"config.json {flag}=true is not supported for {model_type}")
  out: dict[str, Any] = {"decoder_block": block, **FIXED.get(block, {})}
  out |= {flag: bool(hf.get(flag)) for flag in BIASES.get(block, ())}
  hf = {**hf, "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]}
  for src, dst in {**COMMON, **EXTRA.get(block, {})}.items():
    if src in hf:
      out[dst] = hf[src] if hf[src] is not None else 0
  act = hf.get("hidden_activation") or hf.get("hidden_act")
  if act not in ACTIVATIONS:
    raise ConfigError(f"config.json activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
  out["mlp_activations"] = ACTIVATIONS[act]
  if block == "deepseek":
    out |= _deepseek_routing(hf)
  if block == "llama4":
    _check_llama4_layers(hf)
  if block == "gpt_oss":
    _check_gpt_oss_layers(hf)
  if block == "qwen3next":
    out |= _qwen3_next_keys(hf)
  rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
  if block == "gemma3":
    out |= _rope_keys(rope["full_attention"], "rope_max_timescale", hf)
    out["local_rope_max_timescale"] = rope["sliding_attention"]["rope_theta"]
  else:
    out |= _rope_keys(rope, "rope_max_timescale", hf)
  return out


def hf_config(c: Config, dtype: str) -> dict[str, Any]:
  """MaxText config -> config.json for the matching transformers class."""
  if c.decoder_block == "gpt3":
    return gpt2_mapping.hf_config(c, dtype)
  if c.use_multimodal and c.decoder_block == "llama4":
    return llama4_vision_mapping.hf_config(c, hf_config(c.replace(use_multimodal=False), dtype), dtype)
  if c.decoder_block not in HF_ARCH:
    raise ConfigError(f"decoder_block {c.decoder_block!r} has no Hugging Face export; supported: {', '.join(HF_ARCH)}")
  model_type, arch = HF_ARCH[c.decoder_block]
  extra = EXTRA.get(c.decoder_block, {})
  if c.decoder_block == "qwen3" and c.num_experts > 1:
    model_type, arch = "qwen3_moe", "Qwen3MoeForCausalLM"
  elif c.decoder_block == "qwen3":
    extra = {}
  fields = {}
  if c.decoder_block == "deepseek":
    model_type, arch, fields = _deepseek_arch(c)
  out: dict[str, Any] = {"model_type": model_type, "architectures": [arch], "dtype": dtype, **fields}
  for flag in ("attention_bias", "mlp_bias"):
    fixed = FIXED.get(c.decoder_block, {}).get(flag)  # gpt_oss: biased experts, checked below
    if c[flag] and flag not in BIASES.get(c.decoder_block, ()) and not fixed:
      raise ConfigError(f"{flag}=true has no Hugging Face export for decoder_block={c.decoder_block}")
  out |= {flag: c[flag] for flag in BIASES.get(c.decoder_block, ())}
  for src, dst in {**COMMON, **extra}.items():
    out[src] = c[dst]
  out["num_attention_heads"], out["num_key_value_heads"] = c.num_query_heads, c.num_kv_heads
  out["hidden_size"], out["intermediate_size"] = c.emb_dim, c.mlp_dim
  out["num_hidden_layers"] = c.num_decoder_layers
  if c.decoder_block == "llama4":
    wrong = {k: c[k] for k, v in FIXED["llama4"].items() if c[k] != v}
    if wrong:
      raise ConfigError(f"llama4_text fixes {FIXED['llama4']}; this config has {wrong}, which it cannot represent")
    out["intermediate_size"], out["intermediate_size_mlp"] = c.moe_mlp_dim, c.mlp_dim
    out["floor_scale"] = int(out["floor_scale"])
  if c.decoder_block == "gpt_oss":
    wrong = {k: c[k] for k, v in FIXED["gpt_oss"].items() if c[k] != v}
    if wrong or c.moe_mlp_dim != c.mlp_dim or c.num_experts <= 1:
      raise ConfigError(f"gpt_oss fixes {FIXED['gpt_oss']}, MoE layers and moe_mlp_dim = mlp_dim; got {wrong}")
  if c.decoder_block == "qwen3next":
    if not (c.shared_experts and c.shared_expert_gate and c.num_experts > 1):
      raise ConfigError(
        "qwen3_next export needs num_experts > 1 and one gated shared expert (shared_experts, shared_expert_gate)"
      )
    out["shared_expert_intermediate_size"] = c.shared_experts * c.moe_mlp_dim
    out["decoder_sparse_step"], out["mlp_only_layers"] = 1, []
    interval, layers = c.full_attention_interval, c.num_decoder_layers
    out["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
  if c.decoder_block == "deepseek":  # transformers' default is 1, with no MTP weights to load
    out["num_nextn_predict_layers"] = c.mtp_num_layers
  for key in (
    "sliding_window",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "q_lora_rank",
    "attention_chunk_size",
  ):
    if out.get(key) == 0:
      out[key] = None
  if "query_pre_attn_scalar" in out:  # an int in transformers' config classes
    out["query_pre_attn_scalar"] = int(out["query_pre_attn_scalar"])
  act_key = "hidden_activation" if c.decoder_block.startswith("gemma") else "hidden_act"
  out[act_key] = next(k for k, v in ACTIVATIONS.items() if v == list(c.mlp_activations))
  rope = _rope_parameters(c, c.rope_type, c.rope_max_timescale)
  if c.rope_type == "yarn":  # the length yarn extends to; transformers checks it against factor
    out["max_position_embeddings"] = int(c.original_max_position_embeddings * c.rope_factor)
  if c.decoder_block == "gemma3":
    rope = {"full_attention": rope, "sliding_attention": _rope_parameters(c, "default", c.local_rope_max_timescale)}
  if c.decoder_block == "qwen3next":
    rope["partial_rotary_factor"] = c.partial_rotary_factor
  out["rope_parameters"] = rope
  if c.use_multimodal:
    if c.decoder_block != "gemma3":
      raise ConfigError(
        f"use_multimodal has a Hugging Face export for decoder_block=gemma3 only, not {c.decoder_block}"
      )
    vision = {src: c[dst] for src, dst in VISION_KEYS.items()}
    vision |= {"model_type": "siglip_vision_model", "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
    text = {k: v for k, v in out.items() if k not in ("architectures", "dtype")} | {"model_type": "gemma3_text"}
    out = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "dtype": dtype}
    out |= {"text_config": text, "vision_config": vision, "mm_tokens_per_image": c.mm_tokens_per_image}
    out |= {"image_token_index": c.image_token_id, "tie_word_embeddings": c.logits_via_embedding}
    out |= {"boi_token_index": c.image_start_token_id, "eoi_token_index": c.image_end_token_id}
  return out


class Rule(NamedTuple):
  hf_name: str
  path: tuple[Any, ...]  # path in the params pure dict
  index: tuple[int, ...]  # slice of a stacked parameter
  n_in: int | None  # None: copy; else a linear weight whose kernel has n_in input dims
  perm: list[int] | None = None  # permutation of our layout's last axis (DeepSeek's interleaved rope dims)
  transpose: bool = True  # linear weights: HF [out, in] (torch Linear); False: [in, out] (GPT-2 Conv1D)
  cols: tuple[int, ...] | None = None  # slice(*cols) of a fused HF tensor's columns (GPT-2's c_attn; gpt-oss's
  # interleaved gate/up columns: (0, None, 2) and (1, None, 2))
  conv: bool = False  # a torch Conv2d weight [out, in dims...] (SigLIP's patch embedding), not flattened


def deinterleave(first: int, rope: int) -> list[int]:
  """Permutation of a last axis [first dims, rope dims] that turns DeepSeek's interleaved rope pairs
  (0, 1), (2, 3), ... into the halves layout (evens, then odds)."""
  return list(range(first)) + [first + i for i in range(0, rope, 2)] + [first + i for i in range(1, rope, 2)]


def _attention_rules(c: Config) -> Iterator[tuple]:
  """(HF suffix, path inside the layer, expert index, n_in, last-axis permutation) of the attention."""
  if c.decoder_block != "deepseek":
    # Llama 4 rotates interleaved pairs (complex RoPE): q/k head dims are reordered into our halves layout.
    perm = deinterleave(0, c.head_dim) if c.decoder_block == "llama4" else None
    for hf, mt in (("q", "query"), ("k", "key"), ("v", "value")):
      qk_perm = perm if hf != "v" else None
      yield f"self_attn.{hf}_proj.weight", ("self_attention", mt, "kernel"), (), 1, qk_perm
      if c.attention_bias:
        yield f"self_attn.{hf}_proj.bias", ("self_attention", mt, "bias"), (), None, qk_perm
  else:
    q_perm = deinterleave(c.qk_nope_head_dim, c.qk_rope_head_dim)
    if c.q_lora_rank:
      yield "self_attn.q_a_proj.weight", ("self_attention", "wq_a", "kernel"), (), 1, None
      yield "self_attn.q_a_layernorm.weight", ("self_attention", "q_norm", "scale"), (), None, None
      yield "self_attn.q_b_proj.weight", ("self_attention", "wq_b", "kernel"), (), 1, q_perm
    else:
      yield "self_attn.q_proj.weight", ("self_attention", "query", "kernel"), (), 1, q_perm
    kv_perm = deinterleave(c.kv_lora_rank, c.qk_rope_head_dim)
    yield "self_attn.kv_a_proj_with_mqa.weight", ("self_attention", "wkv_a", "kernel"), (), 1, kv_perm
    yield "self_attn.kv_a_layernorm.weight", ("self_attention", "kv_norm", "scale"), (), None, None
    yield "self_attn.kv_b_proj.weight", ("self_attention", "wkv_b", "kernel"), (), 1, None
  yield "self_attn.o_proj.weight", ("self_attention", "out", "kernel"), (), 2, None
  if c.attention_bias:
    yield "self_attn.o_proj.bias", ("self_attention", "out", "bias"), (), None, None
  if c.attention_sink:
    yield "self_attn.sinks", ("self_attention", "sinks"), (), None, None
  if c.use_qk_norm and c.decoder_block != "llama4":  # llama4's q/k norms have no weights
    yield "self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), (), None, None
    yield "self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), (), None, None


def _linear_attention_rules() -> Iterator[tuple]:
  """Qwen3-Next's gated DeltaNet, whose parameters keep HF's fused layouts (layers/gated_deltanet.py)."""
  for hf, mt, n_in in (
    ("in_proj_qkvz.weight", ("in_proj_qkvz", "kernel"), 1),
    ("in_proj_ba.weight", ("in_proj_ba", "kernel"), 1),
    ("conv1d.weight", ("conv1d",), None),
    ("dt_bias", ("dt_bias",), None),
    ("A_log", ("A_log",), None),
    ("norm.weight", ("norm", "scale"), None),
    ("out_proj.weight", ("out", "kernel"), 2),
  ):
    yield f"linear_attn.{hf}", ("self_attention", *mt), (), n_in, None


def _mlp_rules(c: Config, prefix: str, path: tuple) -> Iterator[tuple]:
  for hf, mt in (("gate_proj", ("wi", 0)), ("up_proj", ("wi", 1)), ("down_proj", ("wo",))):
    yield f"{prefix}.{hf}.weight", (*path, *mt, "kernel"), (), 1, None
    if c.mlp_bias:
      yield f"{prefix}.{hf}.bias", (*path, *mt, "bias"), (), None, None


def _llama4_feed_forward_rules(c: Config, moe: bool) -> Iterator[tuple]:
  """Llama 4 keeps experts fused: gate_up_proj [E, D, 2F] (gate columns, then up) and down_proj [E, F, D],
  both [in, out] per expert like ours, so they are copied (cut into column ranges) and not transposed."""
  if not moe:
    yield from _mlp_rules(c, "feed_forward", ("mlp",))
    return
  f = c.moe_mlp_dim
  yield "feed_forward.router.weight", ("mlp", "gate", "kernel"), (), 1, None
  yield "feed_forward.experts.gate_up_proj", ("mlp", "wi_0"), (), None, None, (0, f)
  yield "feed_forward.experts.gate_up_proj", ("mlp", "wi_1"), (), None, None, (f, 2 * f)
  yield "feed_forward.experts.down_proj", ("mlp", "wo"), (), None, None
  yield from _mlp_rules(c, "feed_forward.shared_expert", ("mlp", "shared_experts"))


def _gpt_oss_feed_forward_rules() -> Iterator[tuple]:
  """gpt-oss keeps experts fused, [in, out] per expert like ours: gate_up_proj [E, D, 2F] with gate and up
  columns interleaved (gate even, up odd), its bias [E, 2F] likewise, down_proj [E, F, D] and its bias [E, D]."""
  yield "mlp.router.weight", ("mlp", "gate", "kernel"), (), 1, None
  yield "mlp.router.bias", ("mlp", "gate", "bias"), (), None, None
  for j, half in enumerate(("wi_0", "wi_1")):
    yield "mlp.experts.gate_up_proj", ("mlp", half), (), None, None, (j, None, 2)
    yield "mlp.experts.gate_up_proj_bias", ("mlp", f"{half}_bias"), (), None, None, (j, None, 2)
  yield "mlp.experts.down_proj", ("mlp", "wo"), (), None, None
  yield "mlp.experts.down_proj_bias", ("mlp", "wo_bias"), (), None, None


def _feed_forward_rules(c: Config, moe: bool) -> Iterator[tuple]:
  if c.decoder_block == "gpt_oss":
    yield from _gpt_oss_feed_forward_rules()
  elif c.decoder_block == "llama4":
    yield from _llama4_feed_forward_rules(c, moe)
  elif not moe:
    yield from _mlp_rules(c, "mlp", ("mlp",))
  elif c.decoder_block in ("deepseek", "qwen3", "qwen3next"):
    yield "mlp.gate.weight", ("mlp", "gate", "kernel"), (), 1, None
    if c.routed_bias:
      yield "mlp.gate.e_score_correction_bias", ("mlp", "gate_bias"), (), None, None
    for e in range(c.num_experts):
      for hf, mt in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")):
        yield f"mlp.experts.{e}.{hf}.weight", ("mlp", mt), (e,), 1, None
    if c.shared_experts and c.decoder_block == "qwen3next":  # one gated shared expert
      yield from _mlp_rules(c, "mlp.shared_expert", ("mlp", "shared_experts"))
      yield "mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), (), 1, None
    elif c.shared_experts:
      yield from _mlp_rules(c, "mlp.shared_experts", ("mlp", "shared_experts"))
  else:
    yield "block_sparse_moe.gate.weight", ("mlp", "gate", "kernel"), (), 1, None
    for e in range(c.num_experts):
      for hf, mt in (("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo")):
        yield f"block_sparse_moe.experts.{e}.{hf}.weight", ("mlp", mt), (e,), 1, None


def _layer_rules(c: Config, moe: bool, linear: bool = False) -> Iterator[tuple]:
  """(HF suffix, path inside the layer, expert index, n_in, permutation) for one decoder layer; `linear`:
  a gated DeltaNet layer (qwen3next)."""
  yield "input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), (), None, None
  yield from _linear_attention_rules() if linear else _attention_rules(c)
  if c.decoder_block in ("gemma2", "gemma3"):
    yield "post_attention_layernorm.weight", ("post_self_attention_norm", "scale"), (), None, None
    yield "pre_feedforward_layernorm.weight", ("post_self_attention_layer_norm", "scale"), (), None, None
    yield "post_feedforward_layernorm.weight", ("post_ffw_norm", "scale"), (), None, None
  else:
    yield "post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"), (), None, None
  yield from _feed_forward_rules(c, moe)


def layer_locations(c: Config, stacks, params: dict) -> list[tuple[tuple[Any, ...], tuple[int, ...]]]:
  """For each decoder layer i: (path prefix, index prefix) of its parameters in the pure dict."""
  out = []
  for stack in stacks:
    tree = params[stack.name]
    block = "sublayers" in (tree if c.scan_layers else tree[0])
    for r in range(stack.repeats):
      for j in range(stack.layers_per_unit):
        sub = ("sublayers", j) if block else ()
        out.append(((stack.name, *sub), (r,)) if c.scan_layers else ((stack.name, r, *sub), ()))
  return out


def rules(c: Config, stacks, params: dict) -> list[Rule]:
  """Every HF tensor of the model with where it goes."""
  if c.decoder_block == "gpt3":
    return _gpt2_rules(c, stacks, params)
  out = [Rule("model.embed_tokens.weight", ("token_embedder", "embedding"), (), None)]
  out.append(Rule("model.norm.weight", ("decoder_norm", "scale"), (), None))
  if not c.logits_via_embedding:
    out.append(Rule("lm_head.weight", ("logits_dense", "kernel"), (), 1))
  for i, (prefix, index) in enumerate(layer_locations(c, stacks, params)):
    moe = c.num_experts > 1 and i >= c.first_num_dense_layers
    if c.decoder_block == "llama4":
      moe = c.num_experts > 1 and (i + 1) % c.interleave_moe_layer_step == 0  # models/llama4.is_moe_layer
    linear = c.decoder_block == "qwen3next" and (i + 1) % c.full_attention_interval != 0  # models/qwen3next
    for suffix, path, expert, n_in, perm, *cols in _layer_rules(c, moe, linear):
      rule = Rule(f"model.layers.{i}.{suffix}", prefix + path, index + expert, n_in, perm, cols=(cols or [None])[0])
      out.append(rule)
  out += _mtp_rules(c)
  if c.use_multimodal and c.decoder_block == "llama4":  # Llama4ForConditionalGeneration
    out = [r._replace(hf_name=llama4_vision_mapping.TEXT_PREFIX + r.hf_name) for r in out]
    out += [Rule(name, path, index, n_in) for name, path, index, n_in in llama4_vision_mapping.rules(c)]
  elif c.use_multimodal:  # Gemma 3: the text model under language_model., then the vision tower and projector
    out = [r._replace(hf_name=TEXT_PREFIX + r.hf_name if r.hf_name.startswith("model.") else r.hf_name) for r in out]
    out += _vision_rules(c)
  return out


def _vision_rules(c: Config) -> list[Rule]:
  """The SigLIP tower (vision_tower.) and Gemma 3's projector, into layers/vision.VisionEncoder."""
  root = ("vision_encoder",)
  out = [
    Rule("vision_tower.embeddings.patch_embedding.weight", (*root, "patch_embedding", "kernel"), (), 3, conv=True),
    Rule("vision_tower.embeddings.patch_embedding.bias", (*root, "patch_embedding", "bias"), (), None),
    Rule("vision_tower.embeddings.position_embedding.weight", (*root, "position_embedding"), (), None),
    Rule("vision_tower.post_layernorm.weight", (*root, "post_layernorm", "scale"), (), None),
    Rule("vision_tower.post_layernorm.bias", (*root, "post_layernorm", "bias"), (), None),
    Rule("multi_modal_projector.mm_soft_emb_norm.weight", (*root, "mm_soft_emb_norm", "scale"), (), None),
    # [vision width, emb_dim]: already [in, out]
    Rule("multi_modal_projector.mm_input_projection_weight", (*root, "mm_input_projection", "kernel"), (), 1)._replace(
      transpose=False
    ),
  ]
  for i in range(c.num_hidden_layers_for_vit):
    hf = f"vision_tower.encoder.layers.{i}."
    ours, index = llama4_vision_mapping.tower_layer(c, root, i)
    for name, path, n_in in (
      ("self_attn.q_proj", "query", 1),
      ("self_attn.k_proj", "key", 1),
      ("self_attn.v_proj", "value", 1),
      ("self_attn.out_proj", "out", 2),
      ("mlp.fc1", "fc1", 1),
      ("mlp.fc2", "fc2", 1),
    ):
      out.append(Rule(f"{hf}{name}.weight", (*ours, path, "kernel"), index, n_in))
      out.append(Rule(f"{hf}{name}.bias", (*ours, path, "bias"), index, None))
    for norm in ("layer_norm1", "layer_norm2"):
      out.append(Rule(f"{hf}{norm}.weight", (*ours, norm, "scale"), index, None))
      out.append(Rule(f"{hf}{norm}.bias", (*ours, norm, "bias"), index, None))
  return out


# DeepSeek V3's multi-token-prediction module k (k = 0, 1, ...) is checkpoint layer num_hidden_layers + k: these
# tensors of the module (layers/mtp.py), plus a decoder layer's own, plus copies of the shared embedding and
# head (MTP_COPIES).
MTP_TENSORS = (
  ("enorm.weight", ("enorm", "scale"), None),
  ("hnorm.weight", ("hnorm", "scale"), None),
  ("eh_proj.weight", ("eh_proj", "kernel"), 1),  # [D, 2D]: input columns are [embedding, hidden]
  ("shared_head.norm.weight", ("shared_head_norm", "scale"), None),
)


def _mtp_rules(c: Config) -> list[Rule]:
  """The MTP modules' tensors (mtp_num_layers of them; deepseek only, the layout DeepSeek V3 publishes)."""
  if not c.mtp_num_layers:
    return []
  if c.decoder_block != "deepseek":
    raise ConfigError(
      f"mtp_num_layers={c.mtp_num_layers} has a Hugging Face layout for decoder_block=deepseek only; "
      "export with mtp_num_layers=0 (the MTP modules are then left out)"
    )
  out = []
  for k in range(c.mtp_num_layers):
    layer = f"model.layers.{c.num_decoder_layers + k}"
    out += [Rule(f"{layer}.{name}", ("mtp_modules", k, *path), (), n_in) for name, path, n_in in MTP_TENSORS]
    for suffix, path, expert, n_in, perm, *cols in _layer_rules(c, c.num_experts > 1):
      rule = Rule(f"{layer}.{suffix}", ("mtp_modules", k, "layer", *path), expert, n_in, perm, cols=(cols or [None])[0])
      out.append(rule)
  return out


def mtp_copies(c: Config) -> list[Rule]:
  """Export only: each MTP layer's copies of the shared embedding and output head, as DeepSeek's checkpoints
  hold them (the import reads the main model's and skips these)."""
  head = ("token_embedder", "embedding") if c.logits_via_embedding else ("logits_dense", "kernel")
  out = []
  for k in range(c.mtp_num_layers if c.decoder_block == "deepseek" else 0):
    layer = f"model.layers.{c.num_decoder_layers + k}"
    out.append(Rule(f"{layer}.embed_tokens.weight", ("token_embedder", "embedding"), (), None))
    out.append(Rule(f"{layer}.shared_head.head.weight", head, (), None if c.logits_via_embedding else 1))
  return out


def mtp_layers(hf: dict[str, Any], tensor_names: Collection[str]) -> int:
  """How many MTP modules a DeepSeek checkpoint holds: num_nextn_predict_layers when their tensors are there
  (DeepSeek's releases), 0 when not (transformers saves none, yet its config says 1)."""
  if DECODER_BLOCK.get(hf.get("model_type")) != "deepseek":
    return 0
  wanted = hf.get("num_nextn_predict_layers") or 0
  present = [f"model.layers.{hf['num_hidden_layers'] + k}.eh_proj.weight" in tensor_names for k in range(wanted)]
  return present.index(False) if False in present else wanted


def ignored(c: Config, hf_name: str) -> bool:
  """HF tensors the model does not read: DeepSeek's layers after the last decoder layer and MTP module
  (multi-token-prediction layers beyond mtp_num_layers; transformers skips them too), and the MTP
  layers' copies of the embedding and head."""
  parts = hf_name.split(".")
  layer = parts[:2] == ["model", "layers"] and parts[2].isdigit()
  if c.decoder_block != "deepseek" or not layer or int(parts[2]) < c.num_decoder_layers:
    return False
  copy = ".".join(parts[3:]) in ("embed_tokens.weight", "shared_head.head.weight")
  return int(parts[2]) >= c.num_decoder_layers + c.mtp_num_layers or copy


def _gpt2_rules(c: Config, stacks, params: dict) -> list[Rule]:
  out = [
    Rule(name, path, (), n_in, transpose=False, cols=cols) for name, path, n_in, cols in gpt2_mapping.global_rules()
  ]
  for i, (prefix, index) in enumerate(layer_locations(c, stacks, params)):
    for suffix, path, n_in, cols in gpt2_mapping.layer_rules(c):
      out.append(Rule(f"transformer.h.{i}.{suffix}", prefix + path, index, n_in, transpose=False, cols=cols))
  return out


def hf_shape(rule: Rule, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The HF shape (of the rule's columns) of a parameter slice with our `shape`."""
  if rule.n_in is None:  # torch biases are flat [out]; ours keep the kernel's output dims ([N, H] for q)
    return (math.prod(shape),) if rule.path[-1] == "bias" else tuple(shape)
  rows, cols = math.prod(shape[: rule.n_in]), math.prod(shape[rule.n_in :])
  if rule.conv:
    return (cols, *shape[: rule.n_in])
  return (cols, rows) if rule.transpose else (rows, cols)
