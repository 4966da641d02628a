"""Upstream MaxText's orbax checkpoint trees <-> ours (host numpy trees and optax states; no model, no config).

Upstream writes two trees (facts of maxtext 0.2.5, checked by MaxText/tests/maxtext_checkpoint_test.py
against checkpoints its own train.py wrote):
  linen  train state {params: {params: P}, opt_state, step} (also its older params-only checkpoints, as
         {params: {params: P}})
  nnx    params only, P with every array as {value: array} (its generate_param_only_checkpoint)
where P = {decoder: {layers | layers_<i>, decoder_norm, logits_dense, ...}, token_embedder}. Scanned layers
stack on axis 1 (its param_scan_axis), ours on axis 0; a gated dense MLP names its inputs wi_0/wi_1
(ours: wi/0, wi/1); mixtral's experts live in MoeBlock_0 (ours: mlp), with wi_0/wi_1 or one fused wi; its
attention computes q . k with no 1/sqrt(head_dim) (ours applies it), so its query kernels are ours / sqrt(H).
Its llama3.1 rope (rope_type llama3.1, or a model_name starting llama3.1: our rope_type llama3) rotates
interleaved pairs (dims 2i, 2i+1) where ours rotates halves (i, i + H/2): the query and key kernels' head
dimension is reordered on import (evens first, then odds) and back on export. Its deepseek MLA rotates its rope
dims in interleaved pairs too (reordered alike); its deepseek layers are two stacks, dense_layers and
moe_layers (unrolled: dense_layers_<i>, moe_layers_<i>), as ours. Its gemma3, llama4 and gpt-oss scan one cycle
of their layer pattern (6, the NoPE/MoE period, 2 layers) as a block: layers/layers_<k> stacked on axis 1 (ours:
layers/sublayers/<k>), and gemma3's layers past the last whole cycle unstacked in layers_remainder/layers_<k>
(ours: remainder_layers, a stack of one); unrolled, layer j is layers_<j> either way.

Which of our families map is FAMILIES (by decoder_block); family(config) refuses the others in one line.

to_ours gives our names with string keys, unrolled layers as layers/'<i>' and stacked ones with the layer
axis first: the form checkpoint_layouts.relayout fits to a model either way (scan_layers on or off).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from MaxText.errors import ConfigError

SCAN_AXIS = 1  # upstream's param_scan_axis default: where its scanned layers stack
MOE_BLOCK = "MoeBlock_0"  # upstream's routed-experts module in a mixtral layer (ours: mlp)
_LAYER = re.compile(r"((?:dense_|moe_)?layers)_(\d+)")  # a layer of an unrolled stack (deepseek: two stacks)
STACKS = ("layers", "dense_layers", "moe_layers")  # a scanned stack
REMAINDER = "remainder_layers"  # ours: a block family's layers past its last whole cycle (a stack of one)


class Family(NamedTuple):
  """What differs between an upstream family's tree and ours beyond the shared names (one layer's
  self_attention/{query,key,value,out}, mlp/wi_0/wi_1/wo, decoder_norm, token_embedder, logits_dense)."""

  query_scale: bool = True  # upstream folds 1/sqrt(head_dim) into the query kernel (no explicit scalar)
  query_factor: float = 1.0  # with query_scale, ours = upstream * this (family(): 1 / our query scale)
  renames: tuple[tuple[str, str], ...] = ()  # (upstream module name, ours)
  norm_offset: float = 0.0  # ours multiplies by offset + w where upstream multiplies by w: ours = w - offset
  # ours multiplies the input embeddings by sqrt(emb_dim) and upstream does not, and upstream divides the tied
  # logits by sqrt(emb_dim) (its normalize_embedding_logits) and ours does not: ours = upstream's embedding
  # times embed_factor (family(): 1 / sqrt(emb_dim)) gives both
  scaled_embedding: bool = False
  embed_factor: float = 1.0
  rope_pairs: bool = False  # upstream rotates interleaved pairs: reorder the query/key kernels' head dimension
  moe_block: str = MOE_BLOCK  # upstream's routed-experts module (ours: mlp)
  moe_inner: str = ""  # a module inside moe_block holding the routed experts (ours: mlp itself)
  sublayers: tuple[str, ...] = ()  # upstream's name suffixes of a layer's sublayers (ours: sublayers/<i>)
  block: int = 0  # ours groups this many of upstream's unrolled layers_<j> as layers/<j // block>/sublayers/<j % block>
  layers: int = 0  # with block: the model's layer count (family() sets it); those past whole cycles: REMAINDER
  remainder: str = ""  # upstream's scanned module of the layers past the last whole cycle (none: it has no such)
  # MLA (deepseek): (qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim) (family() sets it). Upstream rotates the
  # rope dims (the query kernels' last R, wkv_a's last R) in interleaved pairs, ours in halves: reordered
  mla: tuple[int, int, int] = ()
  gate_bias: bool = False  # routed_bias: upstream's gate/bias (zeros where its tree has none) is our gate_bias

  def for_moments(self) -> Family:
    """The same mapping for AdamW moments (gradient statistics: names and orders move, no offset)."""
    return self._replace(norm_offset=0.0, embed_factor=1.0)


# decoder_block -> its mapping, checked against checkpoints upstream's own train.py wrote
# (MaxText/tests/maxtext_checkpoint_test.py, fixtures/maxtext/)
_GEMMA_NORMS = (
  ("pre_self_attention_norm", "pre_self_attention_layer_norm"),
  ("pre_ffw_norm", "post_self_attention_layer_norm"),
)
FAMILIES = {
  "llama2": Family(),  # llama2, llama3, llama3.1 (rope_pairs: family() sets it from rope_type)
  "mistral": Family(),
  "mixtral": Family(),
  "qwen3": Family(query_scale=False, moe_block="moe_block"),  # upstream scales queries by head_dim ** -0.5
  "gemma": Family(renames=_GEMMA_NORMS, norm_offset=1.0, scaled_embedding=True),
  "gemma2": Family(renames=_GEMMA_NORMS, norm_offset=1.0, scaled_embedding=True, sublayers=("local", "global")),
  # its queries are scaled explicitly, as ours
  "gemma3": Family(
    renames=_GEMMA_NORMS,
    norm_offset=1.0,
    scaled_embedding=True,
    query_scale=False,
    block=6,
    remainder="layers_remainder",
  ),
  # family() sets block; its queries match ours unscaled (checked against upstream's logits)
  "llama4": Family(moe_block="Llama4MoEBlock_0", moe_inner=MOE_BLOCK, query_scale=False),
  # ours pairs its sliding-window and full layers as sublayers 0, 1; queries unscaled, as llama4
  "gpt_oss": Family(
    renames=(("GptOssAttention", "self_attention"),), moe_block="GptOssMlp", block=2, query_scale=False
  ),
  # V2 and V3: MLA scales its queries explicitly, as ours; a dense first stack, then routed + shared experts
  "deepseek": Family(moe_block="DeepSeekMoeBlock_0", moe_inner=MOE_BLOCK, query_scale=False),
}


def family(config: Any) -> Family:
  """The mapping of `config`'s model (its decoder_block, rope_type); a ConfigError for a family with none."""
  block = config.decoder_block
  if block not in FAMILIES:
    raise ConfigError(
      f"an upstream MaxText checkpoint cannot be mapped onto decoder_block={block!r} (model_name="
      f"{config.model_name!r}): upstream checkpoints import for {', '.join(FAMILIES)} only (docs/checkpoints.md); "
      "convert it with upstream's maxtext.checkpoint_conversion.to_huggingface and import that with "
      "MaxText/convert/hf_to_maxtext.py"
    )
  # upstream's LLaMARotaryEmbedding (its rope_type llama3.1, our llama3) rotates interleaved pairs
  fam = FAMILIES[block]._replace(rope_pairs=config.rope_type == "llama3")
  if block == "deepseek":
    fam = fam._replace(mla=(config.qk_nope_head_dim, config.kv_lora_rank, config.qk_rope_head_dim))
    fam = fam._replace(gate_bias=bool(config.routed_bias))
  if block == "llama4":  # ours stacks the layers in blocks of its NoPE and MoE intervals' lcm
    fam = fam._replace(block=math.lcm(config.nope_layer_interval or 1, config.interleave_moe_layer_step))
  # ours multiplies q . k by (query_pre_attn_scalar or head_dim) ** -0.5; a folding upstream by nothing
  fam = fam._replace(query_factor=float(np.sqrt(config.query_pre_attn_scalar or config.head_dim)))
  fam = fam._replace(layers=config.num_decoder_layers) if fam.block else fam
  return fam._replace(embed_factor=float(config.emb_dim**-0.5)) if fam.scaled_embedding else fam


def layout(tree: Any) -> str | None:
  """'linen', 'nnx' or None (not an upstream tree) for a checkpoint's tree (metadata or arrays)."""
  if not isinstance(tree, dict):
    return None
  inner = tree.get("params")
  if isinstance(inner, dict) and isinstance(inner.get("params"), dict) and "decoder" in inner["params"]:
    return "linen"
  if isinstance(tree.get("decoder"), dict) and "token_embedder" in tree:
    return "nnx"
  return None


def params_of(tree: dict, kind: str) -> dict:
  """The parameter tree P inside an upstream checkpoint's tree of the given layout."""
  return tree["params"]["params"] if kind == "linen" else tree


def unwrap(tree: Any) -> Any:
  """{value: array} leaves (the nnx layout) -> arrays."""
  if isinstance(tree, dict):
    if set(tree) == {"value"} and not isinstance(tree["value"], dict):
      return tree["value"]
    return {k: unwrap(v) for k, v in tree.items()}
  return tree


def _rename(tree: Any, fam: Family) -> Any:
  """One layer (or any module) of upstream names -> ours."""
  if not isinstance(tree, dict):
    return tree
  if fam.sublayers and any(str(k).endswith(f"_{fam.sublayers[0]}") for k in tree):  # one layer of sublayers
    parts = [{k[: -len(s) - 1]: v for k, v in tree.items() if k.endswith(f"_{s}")} for s in fam.sublayers]
    return {"sublayers": {str(i): _rename(part, fam) for i, part in enumerate(parts)}}
  out, renames = {}, dict(fam.renames)
  for key, value in tree.items():
    key = renames.get(key, key)
    if key == fam.moe_block:
      out["mlp"] = _rename(value, fam)
    elif fam.moe_inner and key == fam.moe_inner:
      out.update(_rename(value, fam))
    elif key == "self_attention" and isinstance(value, dict) and fam.mla:
      out[key] = _rename(_mla(value, fam, 1), fam)
    elif key == "self_attention" and isinstance(value, dict) and "query" in value:
      out[key] = _rename(_attention(value, fam, 1), fam)
    elif key == "gate" and isinstance(value, dict) and "bias" in value and fam.gate_bias:
      out["gate"], out["gate_bias"] = {k: v for k, v in value.items() if k != "bias"}, value["bias"]
    elif key in ("wi_0", "wi_1") and isinstance(value, dict):  # a dense gated MLP's kernels
      out.setdefault("wi", {})[key[-1]] = _rename(value, fam)
    elif key == "wi" and isinstance(value, dict):  # a dense MLP with one input projection
      out["wi"] = {"0": _rename(value, fam)}
    elif key == "wi" and hasattr(value, "shape"):  # fused experts [E, D, 2F] = wi_0 | wi_1 on the last axis
      out["wi_0"], out["wi_1"] = np.split(np.asarray(value), 2, axis=-1)
    elif fam.norm_offset and key.endswith("norm") and isinstance(value, dict):
      out[key] = _offset_norm(value, -fam.norm_offset)
    elif key == "token_embedder" and fam.embed_factor != 1:
      out[key] = _scale(value, "embedding", fam.embed_factor, 1)
    else:
      out[key] = _rename(value, fam)
  return out


def _attention(attention: dict, fam: Family, direction: int) -> dict:
  """Upstream's self_attention -> ours (direction 1) or back (-1): the query kernel's (and bias') scale, and
  with rope_pairs the query/key head dimension reordered (interleaved pairs <-> halves)."""
  out = dict(attention)
  if fam.query_scale:
    query = _scale_query(out["query"], fam.query_factor, direction)
    out["query"] = _scale(query, "bias", fam.query_factor, direction) if "bias" in query else query
  if fam.rope_pairs:
    for name in ("query", "key"):
      order = _pairs_to_halves(np.shape(out[name]["kernel"])[-1], direction)
      out[name] = {k: np.asarray(v)[..., order] if k in ("kernel", "bias") else v for k, v in out[name].items()}
  return out


def _mla(attention: dict, fam: Family, direction: int) -> dict:
  """Upstream's MLA self_attention -> ours (direction 1) or back (-1): the rope dims of the query kernel (wq_b, or
  query without a query LoRA) and of wkv_a reordered, interleaved pairs <-> halves."""
  nope, rank, rope = fam.mla
  out = dict(attention)
  for name, first in (("query", nope), ("wq_b", nope), ("wkv_a", rank)):
    if name in out:
      order = np.concatenate([np.arange(first), first + _pairs_to_halves(rope, direction)])
      out[name] = {**out[name], "kernel": np.asarray(out[name]["kernel"])[..., order]}
  return out


def _with_gate_bias(tree: Any) -> Any:
  """Our routed-expert modules without a gate_bias (upstream keeps its routing bias out of the params its train
  writes; it starts at zero) given zeros: [E], or [L, E] for a stack (our layer axis first)."""
  if not isinstance(tree, dict):
    return tree
  out = {k: _with_gate_bias(v) for k, v in tree.items()}
  if "gate" in out and "wi_0" in out and "gate_bias" not in out:
    shape = np.shape(out["gate"]["kernel"])
    out["gate_bias"] = np.zeros(shape[:-2] + shape[-1:], np.asarray(out["gate"]["kernel"]).dtype)
  return out


def _index(tree: dict, i: int) -> Any:
  """The key of entry i of a list-like dict (ours: int keys, or their strings)."""
  return i if i in tree else str(i)


def _offset_norm(norm: dict, offset: float) -> dict:
  """A norm's scale plus `offset`: float32 on import (offset < 0, as _scale_query), the scale's dtype on export."""
  scale = np.asarray(norm["scale"])
  moved = scale.astype(np.float32) + np.float32(offset)
  return {**norm, "scale": moved if offset < 0 else moved.astype(scale.dtype)}


def _pairs_to_halves(head_dim: int, direction: int) -> np.ndarray:
  """Indices taking interleaved pairs (2i, 2i+1) to halves (i, i + H/2) (direction 1), or back (-1)."""
  order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
  return order if direction > 0 else np.argsort(order)


def _scale_query(query: dict, factor: float, direction: int) -> dict:
  """Upstream computes q . k without the 1/sqrt(head_dim) factor ours applies (it folds that factor into the
  query kernel's init instead), so its query kernel is ours / sqrt(H): ours = upstream * sqrt(H) (factor
  sqrt(H), or sqrt(query_pre_attn_scalar) where ours scales by that) and back (direction -1)."""
  return _scale(query, "kernel", factor, direction)


def _scale(module: dict, name: str, factor: float, direction: int) -> dict:
  """module[name] times factor (direction 1: an import, kept float32, as a bf16 array times sqrt(H) is not
  bf16-exact and the model casts to its weight_dtype) or divided by it (-1: an export, in the array's dtype)."""
  array = np.asarray(module[name])
  scaled = array.astype(np.float32) * np.float32(factor**direction)
  return {**module, name: scaled if direction > 0 else scaled.astype(array.dtype)}


def _move_axis(tree: Any, source: int, target: int) -> Any:
  if isinstance(tree, dict):
    return {k: _move_axis(v, source, target) for k, v in tree.items()}
  return np.moveaxis(np.asarray(tree), source, target)


def to_ours(params: dict, fam: Family) -> dict:
  """Upstream P (either layout's leaves) of family `fam` -> our parameter names (see the module docstring)."""
  params = unwrap(params)
  out = _rename({k: v for k, v in params.items() if k != "decoder"}, fam)
  for key, value in params.get("decoder", {}).items():
    match = _LAYER.fullmatch(key)
    if match and fam.block:
      stack, i, k = _in_block(int(match.group(2)), fam)
      out.setdefault(stack, {}).setdefault(i, {"sublayers": {}})["sublayers"][k] = _rename(value, fam)
    elif key == "layers" and fam.block:  # whole cycles: layers_<k> each stacked on axis 1
      subs = {_LAYER.fullmatch(k).group(2): _move_axis(_rename(v, fam), SCAN_AXIS, 0) for k, v in value.items()}
      out["layers"] = {"sublayers": subs}
    elif fam.remainder and key == fam.remainder:  # the rest: one unstacked layers_<k> each
      out[REMAINDER] = {"0": {"sublayers": {_LAYER.fullmatch(k).group(2): _rename(v, fam) for k, v in value.items()}}}
    elif match:
      out.setdefault(match.group(1), {})[match.group(2)] = _rename(value, fam)
    elif key in STACKS:  # stacked on axis 1: the rope reorder (last axis) is the same before or after
      out[key] = _move_axis(_rename(value, fam), SCAN_AXIS, 0)
    else:
      out.update(_rename({key: value}, fam))
  return _with_gate_bias(out) if fam.gate_bias else out


def _in_block(j: int, fam: Family) -> tuple[str, str, str]:
  """Upstream's unrolled layers_<j> of a block family -> (our stack, its entry, the sublayer)."""
  whole = fam.layers // fam.block * fam.block
  if j >= whole:
    return REMAINDER, "0", str(j - whole)
  return "layers", str(j // fam.block), str(j % fam.block)


def _export_names(tree: Any, fam: Family) -> Any:
  """One of our layers (or modules) -> upstream names: the inverse of _rename."""
  if not isinstance(tree, dict):
    return tree
  out, renames = {}, {ours: theirs for theirs, ours in fam.renames}
  for key, value in tree.items():
    key = str(key)
    if fam.norm_offset and key.endswith("norm") and isinstance(value, dict):
      out[renames.get(key, key)] = _offset_norm(value, fam.norm_offset)
    elif key == "token_embedder" and fam.embed_factor != 1:
      out[key] = _scale(value, "embedding", fam.embed_factor, -1)
    elif key == "self_attention" and isinstance(value, dict) and fam.mla:
      out[key] = _export_names(_mla(value, fam, -1), fam)
    elif key == "self_attention" and isinstance(value, dict) and "query" in value:
      out[renames.get(key, key)] = _export_names(_attention(value, fam, -1), fam)
    elif key == "gate_bias":  # upstream's train keeps a zero one out of the params; its converters write gate/bias
      if np.any(np.asarray(value)):
        out.setdefault("gate", {})["bias"] = value
    elif key == "gate" and isinstance(value, dict):
      out.setdefault("gate", {}).update(_export_names(value, fam))
    elif key == "mlp" and isinstance(value, dict) and "gate" in value and fam.moe_inner:
      moe = _export_names(value, fam)
      shared = {k: moe.pop(k) for k in list(moe) if k == "shared_experts"}
      out[fam.moe_block] = {fam.moe_inner: moe, **shared}
    elif key == "mlp" and isinstance(value, dict) and "gate" in value:
      out[fam.moe_block] = _export_names(value, fam)
    elif key == "sublayers" and fam.sublayers:
      for i, suffix in enumerate(fam.sublayers):
        out.update({f"{k}_{suffix}": v for k, v in _export_names(value[_index(value, i)], fam).items()})
    elif key == "wi" and isinstance(value, dict) and len(value) == 1:
      out["wi"] = _export_names(next(iter(value.values())), fam)
    elif key == "wi" and isinstance(value, dict):
      out.update({f"wi_{k}": _export_names(v, fam) for k, v in value.items()})
    else:
      out[renames.get(key, key)] = _export_names(value, fam)
  return out


def from_ours(params: dict, fam: Family) -> dict:
  """Our params (a pure dict of arrays: layers stacked on axis 0, or layers/<i>) of family `fam` -> upstream P."""
  decoder: dict = {}
  out: dict = {"decoder": decoder}
  for key, value in params.items():
    key = str(key)
    if key == "token_embedder":
      out.update(_export_names({key: value}, fam))
    elif key in ("layers", REMAINDER) and fam.block and all(str(k).isdigit() for k in value):
      first = 0 if key == "layers" else fam.layers // fam.block * fam.block
      for i, layer in value.items():
        subs = {first + int(i) * fam.block + int(k): _export_names(v, fam) for k, v in layer["sublayers"].items()}
        decoder.update({f"layers_{j}": v for j, v in subs.items()})
    elif key == "layers" and fam.block:  # stacked cycles: upstream's layers/layers_<k>, each on its axis 1
      subs = value["sublayers"].items()
      decoder["layers"] = {f"layers_{k}": _move_axis(_export_names(v, fam), 0, SCAN_AXIS) for k, v in subs}
    elif key == REMAINDER and fam.block:  # a stack of one: upstream's remainder module, unstacked
      subs = {k: jax.tree.map(lambda a: np.asarray(a)[0], v) for k, v in value["sublayers"].items()}
      decoder[fam.remainder] = {f"layers_{k}": _export_names(v, fam) for k, v in subs.items()}
    elif key in STACKS and all(str(k).isdigit() for k in value):
      decoder.update({f"{key}_{k}": _export_names(v, fam) for k, v in value.items()})
    elif key in STACKS:
      decoder[key] = _move_axis(_export_names(value, fam), 0, SCAN_AXIS)
    else:
      decoder.update(_export_names({key: value}, fam))
  return out


def adam_of(opt_state: Any) -> tuple[Any, Any, Any] | None:
  """(count, mu, nu) of the Adam(W) state in upstream's opt_state (as restored: lists/dicts), or None."""
  if isinstance(opt_state, dict):
    if {"count", "mu", "nu"} <= set(opt_state):
      return opt_state["count"], opt_state["mu"], opt_state["nu"]
    opt_state = list(opt_state.values())
  if isinstance(opt_state, (list, tuple)):
    for part in opt_state:
      found = adam_of(part)
      if found is not None:
        return found
  return None


def with_adam(opt_state: Any, count: Any, mu: Any, nu: Any, fit: Callable[[Any, Any], Any]) -> Any | None:
  """Our optax state `opt_state` with upstream's AdamW `count` in its Adam and schedule counts, and its moments
  `mu`, `nu` (upstream trees) put in place by fit(moment, our moment) -> ours; the rest of our state (e.g.
  skip_spikes' history) is kept. None when `opt_state` has no Adam state to take them."""
  is_state = lambda x: isinstance(x, (optax.ScaleByAdamState, optax.ScaleByScheduleState))  # noqa: E731
  if not any(isinstance(x, optax.ScaleByAdamState) for x in jax.tree.leaves(opt_state, is_leaf=is_state)):
    return None

  def take(part: Any) -> Any:
    if isinstance(part, optax.ScaleByAdamState):
      steps = np.asarray(count, part.count.dtype)
      return part._replace(count=steps, mu=fit(mu, part.mu), nu=fit(nu, part.nu))
    if isinstance(part, optax.ScaleByScheduleState):
      return part._replace(count=np.asarray(count, part.count.dtype))
    return part

  return jax.tree.map(take, opt_state, is_leaf=is_state)
