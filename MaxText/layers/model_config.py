"""The model's own description: what the layers and model families read, in small typed frozen sections.

`models.build` makes one from the run's Config (`ModelConfig.from_config`); the layers never see the rest
of the run (data, optimizer, checkpoints, mesh, outputs). How the model runs (attention kernel, context
split, pipeline, MoE dispatch, remat, dropout, the KV cache's storage) is the run plan's (parallel/plan.py);
LoRA adapters are layers/lora.LoraConfig's. Each leaf field is a key of configs/base.yml's model sections
(`# ---- model ...`), with its comment there; model_config_test checks the two lists against each other.
Choice fields are `Literal`s, checked when a section is made (config_checks.check_choice, which config.py
also runs on them at load).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, ClassVar, Literal

from MaxText.config_checks import check_choice

DecoderBlock = Literal[
  "default", "llama2", "mistral", "mixtral", "qwen3", "gemma", "gemma2", "gemma3", "deepseek", "llama4", "gpt3",
  "gpt_oss", "qwen3next",
  "glm4_moe",
  "olmo3",
  "minimax_m2",
  "qwen3_5",
  "gemma4",
]  # fmt: skip  # models.REGISTRY's keys (model_config_test checks)
Dtype = Literal["bfloat16", "float32", "float16"]
WeightDtype = Literal["float32", "bfloat16"]
RopeType = Literal["default", "llama3", "linear", "yarn", "proportional"]
Activation = Literal["silu", "gelu", "gelu_exact", "relu", "linear"]  # layers/mlp.ACTIVATIONS' keys
CapacityGroup = Literal["global", "sequence", "shard"]
ScoreFunc = Literal["softmax", "sigmoid"]
GroupScore = Literal["top2_sum", "max"]


class Section:
  """A frozen group of model keys whose `Literal` fields are checked when it is made."""

  def __post_init__(self) -> None:
    for f in dataclasses.fields(self):
      kind, value = _hints(type(self))[f.name], getattr(self, f.name)
      if typing.get_origin(kind) is Literal:
        check_choice(f.name, value, typing.get_args(kind))
      elif typing.get_origin(kind) is tuple and typing.get_origin(typing.get_args(kind)[0]) is Literal:
        for entry in value:
          check_choice(f.name, entry, typing.get_args(typing.get_args(kind)[0]))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class Attention(Section):
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
  global_head_dim: int  # gemma4's full-attention layers
  global_num_kv_heads: int
  attention_k_eq_v: bool
  num_kv_shared_layers: int


@dataclasses.dataclass(frozen=True)
class Rope(Section):
  rope_type: RopeType
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
  partial_rotary_factor: float


@dataclasses.dataclass(frozen=True)
class Mla(Section):
  """Multi-head latent attention (deepseek)."""

  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  index_n_heads: int  # DeepSeek V3.2's lightning indexer (layers/indexer.py); 0: off
  index_head_dim: int
  index_topk: int


@dataclasses.dataclass(frozen=True)
class Mlp(Section):
  mlp_activations: tuple[Activation, ...]
  mlp_bias: bool
  use_double_wide_mlp: bool  # gemma4's kv-sharing layers


@dataclasses.dataclass(frozen=True)
class Moe(Section):
  """Mixture of experts (num_experts > 1)."""

  num_experts: int
  num_experts_per_tok: int
  moe_mlp_dim: int
  shared_experts: int
  first_num_dense_layers: int
  interleave_moe_layer_step: int
  capacity_factor: float
  capacity_group: CapacityGroup
  routed_score_func: ScoreFunc
  routed_bias: bool
  routed_scaling_factor: float
  routed_weight_on_input: bool
  router_bias: bool
  mlp_activations_limit: float
  swiglu_alpha: float
  routed_group_score: GroupScore
  norm_topk_prob: bool
  n_routing_groups: int
  topk_routing_group: int
  shared_expert_gate: bool


@dataclasses.dataclass(frozen=True)
class Norms(Section):
  normalization_layer_epsilon: float
  use_post_attn_norm: bool
  use_post_ffw_norm: bool


@dataclasses.dataclass(frozen=True)
class Embed(Section):
  """The token and position embeddings and the logits head."""

  logits_via_embedding: bool
  logits_dot_in_fp32: bool
  final_logits_soft_cap: float
  use_iota_embed: bool
  trainable_position_size: int
  hidden_size_per_layer_input: int  # gemma4's per-layer embeddings
  vocab_size_per_layer_input: int


@dataclasses.dataclass(frozen=True)
class LinearAttention(Section):
  """Qwen3-Next's gated DeltaNet layers and where its full-attention layers sit."""

  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel_dim: int
  linear_chunk_size: int
  full_attention_interval: int


@dataclasses.dataclass(frozen=True)
class Llama4Vision(Section):
  """What Llama 4's vision tower adds to the shared tower keys (models/llama4_vision.py)."""

  pixel_shuffle_ratio_for_vit: float
  projector_input_dim_for_vit: int
  projector_output_dim_for_vit: int
  rope_theta_for_vit: float


@dataclasses.dataclass(frozen=True)
class Vision(Section):
  """Images in: the vision tower (Gemma 3's SigLIP, or the family's own), its projector, the placeholder token."""

  SWITCH: ClassVar[str] = "use_multimodal"  # the key that turns the section on; off: ModelConfig.vision is None

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
  llama4: Llama4Vision


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
  decoder_block: DecoderBlock
  vocab_size: int
  emb_dim: int
  num_decoder_layers: int
  num_query_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  dtype: Dtype
  weight_dtype: WeightDtype
  scan_layers: bool  # stacked (scanned) or separate layers: the parameter layout
  mtp_num_layers: int
  attention: Attention
  rope: Rope
  mla: Mla
  mlp: Mlp
  moe: Moe
  norms: Norms
  embed: Embed
  linear: LinearAttention
  vision: Vision | None  # None without use_multimodal

  @classmethod
  def from_config(cls, config: Any) -> ModelConfig:
    """The model keys of a run Config (or of a ModelConfig: returned as is)."""
    return config if isinstance(config, cls) else _make(cls, config)


def _section_type(kind: Any) -> type | None:
  """The Section class of a field's type (`Vision | None` gives Vision), else None."""
  for t in (kind, *typing.get_args(kind)):
    if isinstance(t, type) and issubclass(t, Section):
      return t
  return None


def _make(cls: type, config: Any) -> Any:
  values = {}
  for f in dataclasses.fields(cls):
    kind = _hints(cls)[f.name]
    section = _section_type(kind)
    if section is not None:
      switch = getattr(section, "SWITCH", None)
      values[f.name] = _make(section, config) if switch is None or config[switch] else None
    elif typing.get_origin(kind) is tuple:
      values[f.name] = tuple(config[f.name])  # frozen and hashable, like the rest
    else:
      values[f.name] = config[f.name]
  return cls(**values)


def leaf_keys(cls: type = ModelConfig) -> dict[str, Any]:
  """Every leaf field of `cls` and its sections -> its type: the config keys a model is made from."""
  out = {}
  for f in dataclasses.fields(cls):
    kind = _hints(cls)[f.name]
    section = _section_type(kind)
    out.update(leaf_keys(section) if section is not None else {f.name: kind})
  return out


def switches(cls: type = ModelConfig) -> tuple[str, ...]:
  """The keys that turn optional sections on (use_multimodal)."""
  out = ()
  for f in dataclasses.fields(cls):
    section = _section_type(_hints(cls)[f.name])
    if section is not None:
      out += ((section.SWITCH,) if hasattr(section, "SWITCH") else ()) + switches(section)
  return out


# Scalar choice keys -> their values, for config.py's load-time check (decoder_block is the run plan's: its
# message lists models.REGISTRY).
CHOICES = {
  k: typing.get_args(t) for k, t in leaf_keys().items() if typing.get_origin(t) is Literal and k != "decoder_block"
}
