"""DeepSeek V2 / V3 / V3.2 (and Kimi K2) <-> DeepseekV2ForCausalLM / DeepseekV3ForCausalLM /
DeepseekV32ForCausalLM (V3 plus the lightning indexer at self_attn.indexer; index_n_heads > 0): multi-head latent
attention (its rope dims interleaved in the checkpoint, reordered into our halves layout), the router as
transformers runs it (V3 sigmoid with a selection bias, V2 softmax), the experts named mlp.gate, mlp.experts.E
plus mlp.shared_experts, and V3's multi-token-prediction modules as checkpoint layers after the decoder's."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from MaxText.convert import hf_mapping
from MaxText.convert.hf_mapping import Rule, deinterleave
from MaxText.errors import ConfigError

EXTRA = {
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
}
# DeepSeek V3.2's lightning indexer (layers/indexer.py): config.json field -> key, transformers' default.
INDEX = {"index_n_heads": ("index_n_heads", 64), "index_head_dim": ("index_head_dim", 128)}
INDEX |= {"index_topk": ("index_topk", 2048)}
# Its tensors under self_attn.indexer: (name, our path under self_attention.indexer, n_in); its rope dims are in
# the halves layout already (no permutation).
INDEX_TENSORS = (
  ("wq_b.weight", ("wq_b", "kernel"), 1),
  ("wk.weight", ("wk", "kernel"), 1),
  ("k_norm.weight", ("k_norm", "scale"), None),
  ("k_norm.bias", ("k_norm", "bias"), None),
  ("weights_proj.weight", ("weights_proj", "kernel"), 1),
)
V3_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2")  # the sigmoid router with a selection bias

# DeepSeek V3's multi-token-prediction module k (k = 0, 1, ...) is checkpoint layer num_hidden_layers + k: these
# tensors of the module (layers/mtp.py), plus a decoder layer's own, plus copies of the shared embedding and
# head (mtp_copies).
MTP_TENSORS = (
  ("enorm.weight", ("enorm", "scale"), None),
  ("hnorm.weight", ("hnorm", "scale"), None),
  ("eh_proj.weight", ("eh_proj", "kernel"), 1),  # [D, 2D]: input columns are [embedding, hidden]
  ("shared_head.norm.weight", ("shared_head_norm", "scale"), None),
)


def routing(hf: dict[str, Any]) -> dict[str, Any]:
  """DeepSeek's router as transformers runs it: V3 sigmoid scores with a selection bias, groups ranked
  by the sum of their two best experts; V2 softmax scores, no bias, no renormalisation, topk_method
  greedy (no groups) or group_limited_greedy (groups ranked by their best expert)."""
  if hf["model_type"] in V3_TYPES:
    return {"routed_score_func": "sigmoid", "routed_bias": True, "routed_group_score": "top2_sum"}
  method = hf.get("topk_method") or "greedy"
  if method not in ("greedy", "group_limited_greedy"):
    raise ConfigError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
  if hf.get("norm_topk_prob"):
    raise ConfigError("deepseek_v2 norm_topk_prob=true is not supported: transformers' DeepseekV2 never renormalises")
  out = {"routed_score_func": "softmax", "routed_bias": False, "routed_group_score": "max", "norm_topk_prob": False}
  return out | ({"n_routing_groups": 1, "topk_routing_group": 1} if method == "greedy" else {})


def check_v32(hf: dict[str, Any]) -> None:
  """What DeepseekV32's config.json can say that we do not represent: no query latent, MLP or attention layer
  patterns other than first_k_dense_replace dense layers then MoE, each layer with the indexer."""
  if not hf.get("q_lora_rank", 1536):
    raise ConfigError("config.json q_lora_rank must be > 0 for deepseek_v32 (its indexer reads the query latent)")
  n, k = hf["num_hidden_layers"], min(hf.get("first_k_dense_replace", 3), hf["num_hidden_layers"])
  if hf.get("mlp_layer_types") not in (None, ["dense"] * k + ["sparse"] * (n - k)):
    raise ConfigError(f"config.json mlp_layer_types must be first_k_dense_replace={k} dense layers, then sparse")
  if any(t != "indexed_attention" for t in hf.get("layer_types") or ()):
    raise ConfigError("config.json layer_types other than indexed_attention are not supported for deepseek_v32")


def export_arch(c) -> tuple[str, str, dict[str, Any]]:
  """(model_type, architecture, extra config.json fields) of a deepseek config: the router decides."""
  grouped = c.n_routing_groups > 1
  v3 = c.routed_score_func == "sigmoid" and c.routed_bias and not (grouped and c.routed_group_score != "top2_sum")
  if c.index_n_heads and v3:
    return "deepseek_v32", "DeepseekV32ForCausalLM", {}
  if c.index_n_heads:
    raise ConfigError("index_n_heads > 0 exports as deepseek_v32, which has V3's router: set routed_score_func=sigmoid")
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


class DeepSeek(hf_mapping.Mapping):
  decoder_block = "deepseek"
  # Kimi K2: V3 under its own (remote-code) config class
  model_types = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
  arch = ("deepseek_v3", "DeepseekV3ForCausalLM")  # deepseek_v2 for softmax routing (export_arch)
  extra = EXTRA
  biases = ()

  def check(self, hf: dict[str, Any]) -> None:
    if not hf.get("rope_interleave", True):
      raise ConfigError("config.json rope_interleave=false is not supported for deepseek_v3")
    if hf.get("model_type") == "deepseek_v32":
      check_v32(hf)

  def family_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
    if hf["model_type"] != "deepseek_v32":
      return routing(hf)
    return routing(hf) | {key: hf.get(field, default) for field, (key, default) in INDEX.items()}

  def mtp_layers(self, hf: dict[str, Any], tensor_names: Collection[str]) -> int:
    """num_nextn_predict_layers when their tensors are there (DeepSeek's releases), 0 when not (transformers
    saves none, yet its config says 1)."""
    wanted = hf.get("num_nextn_predict_layers") or 0
    present = [f"model.layers.{hf['num_hidden_layers'] + k}.eh_proj.weight" in tensor_names for k in range(wanted)]
    return present.index(False) if False in present else wanted

  def export_arch(self, c) -> tuple[str, str, dict[str, Any], dict[str, str]]:
    index = {field: key for field, (key, _) in INDEX.items()} if c.index_n_heads else {}
    return *export_arch(c), self.extra | index

  def export_fields(self, c, out: dict[str, Any]) -> None:
    out["num_nextn_predict_layers"] = c.mtp_num_layers  # transformers' default is 1, with no MTP weights to load

  def qkv_rules(self, c) -> Iterator[tuple]:
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
    for name, path, n_in in INDEX_TENSORS if c.index_n_heads else ():
      yield f"self_attn.indexer.{name}", ("self_attention", "indexer", *path), (), n_in, None

  def feed_forward_rules(self, c, moe: bool) -> Iterator[tuple]:
    return hf_mapping.routed_experts_rules(c) if moe else hf_mapping.mlp_rules(c, "mlp", ("mlp",))

  def mtp_rules(self, c) -> list[Rule]:
    """The MTP modules' tensors (mtp_num_layers of them, the layout DeepSeek V3 publishes)."""
    out = []
    for k in range(c.mtp_num_layers):
      layer = f"model.layers.{c.num_decoder_layers + k}"
      out += [Rule(f"{layer}.{name}", ("mtp_modules", k, *path), (), n_in) for name, path, n_in in MTP_TENSORS]
      out += hf_mapping.as_rules(layer, ("mtp_modules", k, "layer"), (), self.layer_rules(c, c.num_experts > 1))
    return out

  def mtp_copies(self, c) -> list[Rule]:
    """Each MTP layer's copies of the shared embedding and output head, as DeepSeek's checkpoints hold them
    (the import reads the main model's and skips these)."""
    head = ("token_embedder", "embedding") if c.logits_via_embedding else ("logits_dense", "kernel")
    out = []
    for k in range(c.mtp_num_layers):
      layer = f"model.layers.{c.num_decoder_layers + k}"
      out.append(Rule(f"{layer}.embed_tokens.weight", ("token_embedder", "embedding"), (), None))
      out.append(Rule(f"{layer}.shared_head.head.weight", head, (), None if c.logits_via_embedding else 1))
    return out

  def ignored(self, c, hf_name: str) -> bool:
    """DeepSeek's layers after the last decoder layer and MTP module (multi-token-prediction layers beyond
    mtp_num_layers; transformers skips them too), and the MTP layers' copies of the embedding and head."""
    parts = hf_name.split(".")
    layer = parts[:2] == ["model", "layers"] and parts[2].isdigit()
    if not layer or int(parts[2]) < c.num_decoder_layers:
      return False
    copy = ".".join(parts[3:]) in ("embed_tokens.weight", "shared_head.head.weight")
    return int(parts[2]) >= c.num_decoder_layers + c.mtp_num_layers or copy


MAPPING = DeepSeek()
