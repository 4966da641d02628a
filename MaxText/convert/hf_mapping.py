"""How a Hugging Face checkpoint maps onto ours: the generic part, shared by every family.

`Mapping` is the transformers decoder layout of the shared layers (LlamaForCausalLM's config fields and
tensor names); each family's `models/<family>/hf.py` subclasses it and overrides what its architecture
changes. The converters find a family's mapping through `models.hf_mapping` (by decoder_block) and
`convert.mappings.of_config_json` (by config.json's model_type); no family's tables or branches live here.

Tensor rule: HF name -> (MaxText parameter path, index prefix, n_in). A HF linear weight [out, in] is
the transpose of our kernel reshaped (n_in = how many leading kernel dims are inputs); n_in None means
the tensor is copied as is (norms, embeddings), or flattened (biases). The index prefix selects a slice of a stacked
parameter: the layer (scan_layers=true) and/or the expert.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from MaxText.convert import fp8
from MaxText.errors import ConfigError

if TYPE_CHECKING:
  from MaxText.config import Config

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
NONE_IS_ZERO = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "q_lora_rank")
NONE_IS_ZERO += ("attention_chunk_size",)  # config.json fields whose null is our 0

# Multimodal checkpoints: the text model under language_model. (language_model.model.layers...).
TEXT_PREFIX = "language_model."
# Names other writers use for the same tensors (Google's releases, transformers' in-memory names) -> ours.
ALIASES = (("vision_tower.vision_model.", "vision_tower."), ("model.language_model.", "language_model.model."))
ALIASES += (("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))
# vision_config field -> MaxText key: a vision tower's size, as every vision_config gives it (both towers).
TOWER_KEYS = {
  "image_size": "image_size_for_vit",
  "patch_size": "patch_size_for_vit",
  "num_channels": "num_channels_for_vit",
  "hidden_size": "hidden_size_for_vit",
  "intermediate_size": "intermediate_size_for_vit",
  "num_hidden_layers": "num_hidden_layers_for_vit",
  "num_attention_heads": "num_attention_heads_for_vit",
}


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
  rows: tuple[int, ...] | None = None  # slice(*rows) of a fused HF tensor's second-to-last axis (Gemma 4's
  # gate_up_proj [E, 2F, D]: gate rows (0, F), then up rows (F, 2F))
  stacked: bool = False  # n_in None: a stack of torch Linear weights [E, out, in], each transposed (ours [E, in, out])


def canonical_name(name: str) -> str:
  """A multimodal checkpoint's tensor name in the layout the rules use (the first alias that matches)."""
  for other, ours in ALIASES:
    if name.startswith(other):
      name = ours + name[len(other) :]
  return name


def text_model(hf: dict[str, Any], text_type: str, tie_default: bool) -> dict[str, Any]:
  """An image-text checkpoint's config.json -> its text model's: text_config as model_type `text_type`, tied
  as the image-text class ties its head (the top-level tie_word_embeddings, default `tie_default`)."""
  if not isinstance(hf.get("text_config"), dict):
    raise ConfigError(f"model_type={hf.get('model_type')} config.json needs a text_config object")
  tie = hf.get("tie_word_embeddings", tie_default)
  return {**hf["text_config"], "model_type": text_type, "tie_word_embeddings": tie}


def deinterleave(first: int, rope: int) -> list[int]:
  """Permutation of a last axis [first dims, rope dims] that turns interleaved rope pairs (0, 1), (2, 3), ...
  (DeepSeek's, Llama 4's) into the halves layout (evens, then odds)."""
  return list(range(first)) + [first + i for i in range(0, rope, 2)] + [first + i for i in range(1, rope, 2)]


def hf_shape(rule: Rule, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The HF shape (of the rule's columns) of a parameter slice with our `shape`."""
  if rule.stacked:
    return (*shape[:-2], shape[-1], shape[-2])
  if rule.n_in is None:  # torch biases are flat [out]; ours keep the kernel's output dims ([N, H] for q)
    return (math.prod(shape),) if rule.path[-1] == "bias" else tuple(shape)
  rows, cols = math.prod(shape[: rule.n_in]), math.prod(shape[rule.n_in :])
  if rule.conv:
    return (cols, *shape[: rule.n_in])
  return (cols, rows) if rule.transpose else (rows, cols)


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


def tower_layer(c: Any, root: tuple[str, ...], i: int) -> tuple[tuple[Any, ...], tuple[int, ...]]:
  """(path, index) of encoder layer i of a vision tower under `root` (both towers, layers/vision.py's
  encoder_layers): the stacked `layers` module and slice i under scan_layers, else the i-th module."""
  return ((*root, "layers"), (i,)) if c.scan_layers else ((*root, "layers", i), ())


def rope_keys(params: dict[str, Any], theta_key: str, hf: dict[str, Any]) -> dict[str, Any]:
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


def rope_parameters(c: Config, rope_type: str, theta: float) -> dict[str, Any]:
  """MaxText keys -> rope_parameters of one attention type (the inverse of rope_keys)."""
  out = {"rope_type": rope_type, "rope_theta": float(theta)}
  for hf, mt in ROPE_KEYS[rope_type].items():
    if c[mt] or mt not in UNSET_IS_ZERO:
      out[hf] = c[mt]
  return out


def mlp_rules(c: Config, prefix: str, path: tuple) -> Iterator[tuple]:
  """A gated MLP (gate_proj, up_proj, down_proj) at HF `prefix`, our `path`."""
  for hf, mt in (("gate_proj", ("wi", 0)), ("up_proj", ("wi", 1)), ("down_proj", ("wo",))):
    yield f"{prefix}.{hf}.weight", (*path, *mt, "kernel"), (), 1, None
    if c.mlp_bias:
      yield f"{prefix}.{hf}.bias", (*path, *mt, "bias"), (), None, None


def routed_experts_rules(c: Config, shared: str = "mlp.shared_experts") -> Iterator[tuple]:
  """The router, one gated MLP per expert and the shared experts (at HF `shared`), as Qwen-MoE and DeepSeek
  name them (mlp.gate, mlp.experts.E)."""
  yield "mlp.gate.weight", ("mlp", "gate", "kernel"), (), 1, None
  if c.routed_bias:
    yield "mlp.gate.e_score_correction_bias", ("mlp", "gate_bias"), (), None, None
  for e in range(c.num_experts):
    for hf, mt in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")):
      yield f"mlp.experts.{e}.{hf}.weight", ("mlp", mt), (e,), 1, None
  if c.shared_experts:
    yield from mlp_rules(c, shared, ("mlp", "shared_experts"))


def as_rules(prefix: str, layer: tuple[Any, ...], index: tuple[int, ...], items) -> Iterator[Rule]:
  """Rules from layer_rules' tuples (suffix, path, expert, n_in, perm[, cols, or a dict of further Rule fields])
  of a layer at HF `prefix`, our path `layer` and index `index`."""
  for suffix, path, expert, n_in, perm, *more in items:
    fields = more[0] if more and isinstance(more[0], dict) else {"cols": (more or [None])[0]}
    yield Rule(f"{prefix}.{suffix}", layer + path, index + expert, n_in, perm, **fields)


class Mapping:
  """A family's Hugging Face mapping, both ways: config.json <-> MaxText keys, and HF tensor <-> parameter.
  This base is the transformers decoder layout of the shared layers; a family overrides what it changes."""

  decoder_block = ""
  model_types: tuple[str, ...] = ()  # config.json model_type values this family imports
  multimodal_type = ""  # the model_type of its image-text checkpoints, if any (maxtext_keys reads both)
  towers: tuple[str, ...] = ()  # name prefixes (canonical_name's) of the towers a text-only import skips
  arch = ("", "")  # (model_type, architecture class) it exports as
  extra: dict[str, str] = {}  # HF field -> MaxText key, beyond COMMON
  fixed: dict[str, Any] = {}  # MaxText keys implied by the family
  biases: tuple[str, ...] = ("attention_bias",)  # bias flags (HF field = MaxText key) of its transformers class
  activation_field = "hidden_act"
  qk_norm_weights = True  # q/k norms carry a scale (Llama 4's do not)
  # config.json fields without which the architecture is unknown (a missing one would silently take base.yml's
  # default); checked by hf_to_maxtext before anything is read
  required_fields = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")

  # config.json -> MaxText keys

  def check(self, hf: dict[str, Any]) -> None:
    """ConfigError for a config.json this family's transformers class reads but we cannot represent."""

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    """Keys that do not map field for field (routers, layer patterns)."""
    return {}

  def import_rope(self, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    return rope_keys(rope, "rope_max_timescale", hf)

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the MaxText architecture keys; errors name what cannot be represented."""
    model_type, block = hf.get("model_type"), self.decoder_block
    self.check(hf)
    fp8.block_size(hf)  # FP8 block-scaled weights are dequantized on import; other quantizations fail here
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
      if hf.get(flag) and flag not in self.biases:
        raise ConfigError(f"config.json {flag}=true is not supported for {model_type}")
    out: dict[str, Any] = {"decoder_block": block, **self.fixed}
    out |= {flag: bool(hf.get(flag)) for flag in self.biases}
    hf = {**hf, "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]}
    for src, dst in {**COMMON, **self.extra}.items():
      if src in hf:
        out[dst] = hf[src] if hf[src] is not None else 0
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    if act not in ACTIVATIONS:
      raise ConfigError(f"config.json activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    out["mlp_activations"] = ACTIVATIONS[act]
    out |= self.family_keys(hf)
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    return out | self.import_rope(rope, hf)

  def mtp_layers(self, hf: dict[str, Any], tensor_names: Collection[str]) -> int:
    """How many multi-token-prediction modules the checkpoint holds (DeepSeek's only)."""
    return 0

  # MaxText config -> config.json

  def export_arch(self, c: Config) -> tuple[str, str, dict[str, Any], dict[str, str]]:
    """(model_type, architecture, config.json fields that come first, the family's HF field -> key map)."""
    return *self.arch, {}, self.extra

  def export_fields(self, c: Config, out: dict[str, Any]) -> None:
    """The family's fields that do not map key for key, added to `out` (checks first)."""

  def export_rope(self, c: Config) -> dict[str, Any]:
    return rope_parameters(c, c.rope_type, c.rope_max_timescale)

  def export_multimodal(self, c: Config, out: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The multimodal config.json around the text model's `out`."""
    raise ConfigError(f"use_multimodal has a Hugging Face export for gemma3 and llama4 only, not {c.decoder_block}")

  def hf_config(self, c: Config, dtype: str) -> dict[str, Any]:
    """MaxText config -> config.json for the matching transformers class."""
    model_type, arch, fields, extra = self.export_arch(c)
    out: dict[str, Any] = {"model_type": model_type, "architectures": [arch], "dtype": dtype, **fields}
    for flag in ("attention_bias", "mlp_bias"):
      fixed = self.fixed.get(flag)  # gpt_oss: biased experts, checked by its export_fields
      if c[flag] and flag not in self.biases and not fixed:
        raise ConfigError(f"{flag}=true has no Hugging Face export for decoder_block={c.decoder_block}")
    out |= {flag: c[flag] for flag in self.biases}
    for src, dst in {**COMMON, **extra}.items():
      out[src] = c[dst]
    out["num_attention_heads"], out["num_key_value_heads"] = c.num_query_heads, c.num_kv_heads
    out["hidden_size"], out["intermediate_size"] = c.emb_dim, c.mlp_dim
    out["num_hidden_layers"] = c.num_decoder_layers
    self.export_fields(c, out)
    for key in NONE_IS_ZERO:
      if out.get(key) == 0:
        out[key] = None
    if "query_pre_attn_scalar" in out:  # an int in transformers' config classes
      out["query_pre_attn_scalar"] = int(out["query_pre_attn_scalar"])
    out[self.activation_field] = next(k for k, v in ACTIVATIONS.items() if v == list(c.mlp_activations))
    rope = self.export_rope(c)
    per_type = [rope, *(r for r in rope.values() if isinstance(r, dict))]  # or per attention type (gemma4)
    if c.partial_rotary_factor != 1.0 and not any("partial_rotary_factor" in r for r in per_type):
      raise ConfigError(
        f"partial_rotary_factor={c.partial_rotary_factor} has no Hugging Face export for {c.decoder_block}"
      )
    if c.rope_type == "yarn":  # the length yarn extends to; transformers checks it against factor
      out["max_position_embeddings"] = int(c.original_max_position_embeddings * c.rope_factor)
    out["rope_parameters"] = rope
    return self.export_multimodal(c, out, dtype) if c.use_multimodal else out

  # tensors

  def qkv_rules(self, c: Config) -> Iterator[tuple]:
    """(HF suffix, path inside the layer, expert index, n_in, last-axis permutation) of q, k, v."""
    perm = self.qk_perm(c)
    for hf, mt in (("q", "query"), ("k", "key"), ("v", "value")):
      qk_perm = perm if hf != "v" else None
      yield f"self_attn.{hf}_proj.weight", ("self_attention", mt, "kernel"), (), 1, qk_perm
      if c.attention_bias:
        yield f"self_attn.{hf}_proj.bias", ("self_attention", mt, "bias"), (), None, qk_perm

  def qk_perm(self, c: Config) -> list[int] | None:
    return None

  def attention_rules(self, c: Config, linear: bool) -> Iterator[tuple]:
    yield from self.qkv_rules(c)
    yield "self_attn.o_proj.weight", ("self_attention", "out", "kernel"), (), 2, None
    if c.attention_bias:
      yield "self_attn.o_proj.bias", ("self_attention", "out", "bias"), (), None, None
    if c.attention_sink:
      yield "self_attn.sinks", ("self_attention", "sinks"), (), None, None
    if c.use_qk_norm and self.qk_norm_weights:
      yield "self_attn.q_norm.weight", ("self_attention", "query_norm", "scale"), (), None, None
      yield "self_attn.k_norm.weight", ("self_attention", "key_norm", "scale"), (), None, None

  def norm_rules(self) -> Iterator[tuple]:
    """The norms after the attention."""
    yield "post_attention_layernorm.weight", ("post_self_attention_layer_norm", "scale"), (), None, None

  def feed_forward_rules(self, c: Config, moe: bool) -> Iterator[tuple]:
    """A dense layer's MLP; a MoE layer's router and experts as Mixtral names them."""
    if not moe:
      yield from mlp_rules(c, "mlp", ("mlp",))
      return
    yield "block_sparse_moe.gate.weight", ("mlp", "gate", "kernel"), (), 1, None
    for e in range(c.num_experts):
      for hf, mt in (("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo")):
        yield f"block_sparse_moe.experts.{e}.{hf}.weight", ("mlp", mt), (e,), 1, None

  def layer_rules(self, c: Config, moe: bool, linear: bool = False) -> Iterator[tuple]:
    """(HF suffix, path inside the layer, expert index, n_in, permutation[, columns]) for one decoder layer;
    `linear`: a linear-attention layer (qwen3next)."""
    yield "input_layernorm.weight", ("pre_self_attention_layer_norm", "scale"), (), None, None
    yield from self.attention_rules(c, linear)
    yield from self.norm_rules()
    yield from self.feed_forward_rules(c, moe)

  def is_moe(self, c: Config, i: int) -> bool:
    return c.num_experts > 1 and i >= c.first_num_dense_layers

  def is_linear(self, c: Config, i: int) -> bool:
    return False

  def mtp_rules(self, c: Config) -> list[Rule]:
    if c.mtp_num_layers:
      raise ConfigError(
        f"mtp_num_layers={c.mtp_num_layers} has a Hugging Face layout for decoder_block=deepseek only; "
        "export with mtp_num_layers=0 (the MTP modules are then left out)"
      )
    return []

  def multimodal_rules(self, c: Config, text: list[Rule]) -> list[Rule]:
    """The rules of the multimodal checkpoint around the text model's `text`."""
    raise ConfigError(f"use_multimodal has a Hugging Face layout for gemma3 and llama4 only, not {c.decoder_block}")

  def rules(self, c: Config, stacks, params: dict) -> list[Rule]:
    """Every HF tensor of the model with where it goes."""
    out = [Rule("model.embed_tokens.weight", ("token_embedder", "embedding"), (), None)]
    out.append(Rule("model.norm.weight", ("decoder_norm", "scale"), (), None))
    if not c.logits_via_embedding:
      out.append(Rule("lm_head.weight", ("logits_dense", "kernel"), (), 1))
    for i, (prefix, index) in enumerate(layer_locations(c, stacks, params)):
      items = self.layer_rules(c, self.is_moe(c, i), self.is_linear(c, i))
      out += as_rules(f"model.layers.{i}", prefix, index, items)
    out += self.mtp_rules(c)
    return self.multimodal_rules(c, out) if c.use_multimodal else out

  def mtp_copies(self, c: Config) -> list[Rule]:
    """Export only: tensors the checkpoint repeats (DeepSeek's MTP layers' embedding and head)."""
    return []

  def ignored(self, c: Config, hf_name: str) -> bool:
    """HF tensors the model does not read."""
    return False
