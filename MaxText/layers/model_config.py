"""The model's own configuration: the keys the layers and model families read, typed and frozen.

`models.build` makes one from the run's Config (`ModelConfig.from_config`); the layers never see the rest
of the run (data, optimizer, checkpoints, mesh, outputs). How the model runs (attention kernel, context
split, pipeline, MoE dispatch, remat) is not here either: that is the run plan (parallel/plan.py).
Functions that take a config read it by attribute, so a whole Config works where a ModelConfig is named.
The layers' training-time transforms (quantization.quantize, over the built model) take the run's Config.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  # Sizes and numerics
  decoder_block: str
  vocab_size: int
  emb_dim: int
  num_decoder_layers: int
  num_query_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_target_length: int  # the length LoRA traces a layer at to find its projections
  dtype: str
  weight_dtype: str
  scan_layers: bool  # stacked (scanned) or separate layers: the parameter layout
  # Embeddings, norms, logits
  normalization_layer_epsilon: float
  logits_via_embedding: bool
  logits_dot_in_fp32: bool
  final_logits_soft_cap: float
  use_iota_embed: bool
  trainable_position_size: int
  use_post_attn_norm: bool
  use_post_ffw_norm: bool
  enable_dropout: bool
  dropout_rate: float
  # Attention
  attention_bias: bool
  attn_logits_soft_cap: float
  query_pre_attn_scalar: float
  use_qk_norm: bool
  sliding_window_size: int
  chunk_attn_window_size: int
  nope_layer_interval: int
  temperature_tuning: bool
  temperature_tuning_scale: float
  temperature_tuning_floor_scale: int
  attention_sink: bool
  quantize_kvcache: bool  # decode: the KV cache's storage
  kv_quant_dtype: str
  # RoPE
  rope_type: str
  rope_max_timescale: int
  rope_min_timescale: int
  local_rope_max_timescale: int
  rope_factor: float
  rope_low_freq_factor: float
  rope_high_freq_factor: float
  original_max_position_embeddings: int
  rope_beta_fast: float
  rope_beta_slow: float
  rope_mscale: float
  rope_mscale_all_dim: float
  rope_attention_factor: float
  rope_truncate: bool
  # MLA (deepseek)
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  # MLP and mixture of experts
  mlp_activations: tuple[str, ...]
  mlp_bias: bool
  num_experts: int
  num_experts_per_tok: int
  moe_mlp_dim: int
  shared_experts: int
  first_num_dense_layers: int
  interleave_moe_layer_step: int
  capacity_factor: float
  capacity_group: str
  routed_score_func: str
  routed_bias: bool
  routed_scaling_factor: float
  routed_weight_on_input: bool
  router_bias: bool
  mlp_activations_limit: float
  swiglu_alpha: float
  routed_group_score: str
  norm_topk_prob: bool
  n_routing_groups: int
  topk_routing_group: int
  # Qwen3-Next: gated DeltaNet layers, gated attention, gated shared expert
  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel_dim: int
  linear_chunk_size: int
  full_attention_interval: int
  partial_rotary_factor: float
  shared_expert_gate: bool
  # Images in (use_multimodal): the SigLIP tower, the projector, the placeholder token
  use_multimodal: bool
  image_size_for_vit: int
  patch_size_for_vit: int
  num_channels_for_vit: int
  hidden_size_for_vit: int
  intermediate_size_for_vit: int
  num_hidden_layers_for_vit: int
  num_attention_heads_for_vit: int
  vision_layer_norm_epsilon: float
  mm_tokens_per_image: int
  image_token_id: int
  freeze_vision_encoder: bool  # training: no gradient flows into the vision tower and projector
  # Llama 4's vision tower (models/llama4_vision.py)
  pixel_shuffle_ratio_for_vit: float
  projector_input_dim_for_vit: int
  projector_output_dim_for_vit: int
  rope_theta_for_vit: float
  # Multi-token prediction, LoRA adapters
  mtp_num_layers: int
  lora_rank: int
  lora_alpha: float
  lora_target_modules: str
  lora_vision_target_modules: str  # use_multimodal, freeze_vision_encoder=false: adapted projections of the tower

  @classmethod
  def from_config(cls, config: Any) -> ModelConfig:
    """The model keys of a run Config (or of a ModelConfig: returned as is)."""
    if isinstance(config, cls):
      return config
    values = {f.name: config[f.name] for f in dataclasses.fields(cls)}
    values["mlp_activations"] = tuple(values["mlp_activations"])  # frozen and hashable, like the rest
    return cls(**values)
