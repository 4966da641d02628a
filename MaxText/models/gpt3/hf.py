"""GPT-3 <-> GPT2LMHeadModel (Hugging Face `gpt2`, the architecture of our gpt3 family): its own field names,
Conv1D weights stored [in, out] (no transpose), a fused c_attn [D, 3D] split into query/key/value columns,
biases everywhere, learned positions, tied embeddings."""

from __future__ import annotations

from typing import Any

from MaxText.convert import hf_mapping
from MaxText.convert.hf_mapping import Rule
from MaxText.errors import ConfigError

KEYS = {  # HF field -> MaxText key
  "n_embd": "base_emb_dim",
  "n_head": "base_num_query_heads",
  "n_layer": "base_num_decoder_layers",
  "vocab_size": "vocab_size",
  "layer_norm_epsilon": "normalization_layer_epsilon",
  "n_positions": "trainable_position_size",
}


def maxtext_keys(hf: dict[str, Any]) -> dict[str, Any]:
  for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
    if hf.get(flag):
      raise ConfigError(f"config.json {flag}=true is not supported for gpt2")
  if not hf.get("scale_attn_weights", True) or hf.get("activation_function", "gelu_new") != "gelu_new":
    raise ConfigError("gpt2 conversion needs scale_attn_weights=true and activation_function=gelu_new")
  if not hf.get("tie_word_embeddings", True):
    raise ConfigError("gpt2 conversion needs tie_word_embeddings=true")
  out = {"decoder_block": "gpt3", **{mt: hf[key] for key, mt in KEYS.items()}}
  out["base_num_kv_heads"] = hf["n_head"]
  out["head_dim"] = hf["n_embd"] // hf["n_head"]
  out["base_mlp_dim"] = hf.get("n_inner") or 4 * hf["n_embd"]
  return out | {"mlp_activations": ["gelu"], "logits_via_embedding": True}


def hf_config(c, dtype: str) -> dict[str, Any]:
  out = {key: c[mt] for key, mt in KEYS.items()}
  out |= {"n_embd": c.emb_dim, "n_head": c.num_query_heads, "n_layer": c.num_decoder_layers, "n_inner": c.mlp_dim}
  out |= {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "dtype": dtype}
  return out | {"activation_function": "gelu_new", "tie_word_embeddings": True}


def _norm(hf: str, mt: str) -> list[tuple]:
  return [(f"{hf}.weight", (mt, "scale"), None, None), (f"{hf}.bias", (mt, "bias"), None, None)]


def layer_rules(c) -> list[tuple]:
  """(HF suffix, path in the layer, n_in (Conv1D: input dims of our kernel), columns of the HF tensor)."""
  d = c.num_query_heads * c.head_dim
  out = _norm("ln_1", "pre_self_attention_layer_norm") + _norm("ln_2", "post_self_attention_layer_norm")
  for j, name in enumerate(("query", "key", "value")):
    cols = (j * d, (j + 1) * d)
    out.append(("attn.c_attn.weight", ("self_attention", name, "kernel"), 1, cols))
    out.append(("attn.c_attn.bias", ("self_attention", name, "bias"), None, cols))
  out.append(("attn.c_proj.weight", ("self_attention", "out", "kernel"), 2, None))
  out.append(("attn.c_proj.bias", ("self_attention", "out", "bias"), None, None))
  out.append(("mlp.c_fc.weight", ("mlp", "wi", 0, "kernel"), 1, None))
  out.append(("mlp.c_fc.bias", ("mlp", "wi", 0, "bias"), None, None))
  out.append(("mlp.c_proj.weight", ("mlp", "wo", "kernel"), 1, None))
  out.append(("mlp.c_proj.bias", ("mlp", "wo", "bias"), None, None))
  return out


def global_rules() -> list[tuple]:
  out = [("transformer.wte.weight", ("token_embedder", "embedding"), None, None)]
  out.append(("transformer.wpe.weight", ("position_embedder", "embedding"), None, None))
  return out + [(n, p, None, None) for n, p, _, _ in _norm("transformer.ln_f", "decoder_norm")]


class Gpt2(hf_mapping.Mapping):
  decoder_block = "gpt3"
  model_types = ("gpt2",)
  arch = ("gpt2", "GPT2LMHeadModel")
  required_fields = ()  # its own names, checked by maxtext_keys

  def maxtext_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    return maxtext_keys(hf)

  def hf_config(self, c, dtype: str) -> dict[str, Any]:
    return hf_config(c, dtype)

  def rules(self, c, stacks, params: dict) -> list[Rule]:
    out = [Rule(name, path, (), n_in, transpose=False, cols=cols) for name, path, n_in, cols in global_rules()]
    for i, (prefix, index) in enumerate(hf_mapping.layer_locations(c, stacks, params)):
      for suffix, path, n_in, cols in layer_rules(c):
        out.append(Rule(f"transformer.h.{i}.{suffix}", prefix + path, index, n_in, transpose=False, cols=cols))
    return out


MAPPING = Gpt2()
