"""Model FLOPs per trained token, counted on the model that was built: the numerator of MFU.

No second description of the architecture: the count walks the model's modules (an abstract build,
nothing allocated) and reads from each what it computes. Every projection (DenseGeneral) counts its kernel,
a MoeBlock its experts' weights times k / num_experts (the experts a token is routed to), every attention
module its own window (global causal, sliding, Llama 4's chunks; NoPE layers are global), every gated DeltaNet
its chunked linear-attention cost per token (GatedDeltaNet.forward_flops_per_token), every lightning indexer
(DeepSeek V3.2) its projections and index scores over all keys, forward only (Indexer.forward_flops_per_token),
and the logits head once per application (the main model's, and one per multi-token-prediction module).
Stacked layers (scan_layers) are counted through their kernels' leading layer axis. Layers without a projection
count none: Gemma 4's kv-sharing layers (no key/value projections; their attention still counts) and K = V full
layers (no value projection); its per-layer embeddings count their projections, not their table (a lookup).

    python3 -m MaxText.flops MaxText/configs/base.yml model_name=llama2-7b   # the count for a config
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import jax
from flax import nnx

from MaxText import config as config_lib
from MaxText import state as state_lib
from MaxText.config import Config
from MaxText.layers.attention import Attention
from MaxText.layers.attention_mla import MLAttention
from MaxText.layers.gated_deltanet import GatedDeltaNet
from MaxText.layers.indexer import Indexer
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.moe import MoeBlock

EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")  # a MoeBlock's [E, ...] expert weights; its router is a DenseGeneral
INDEXER = "indexer"  # MLAttention's lightning indexer (DeepSeek V3.2): forward only, counted apart
LOGITS_HEAD = "logits_dense"  # the Decoder's output projection (None when tied to token_embedder)
VISION = "vision_encoder"  # the Decoder's image encoder (layers/vision.py; None without use_multimodal)


class FlopCount(NamedTuple):
  """Training FLOPs per token (forward + backward); `total` is the sum of the parts."""

  total: float
  matmul: float  # decoder-layer weight matmuls: attention projections, MLP / routed + shared experts, router
  attention: float  # the QK^T and AV matmuls of causal (sliding-window, chunked) self-attention
  embedding: float  # the output (unembedding) projection; the input lookup is not a matmul
  vision: float = 0.0  # use_multimodal: the vision tower and projector, per text token (images_per_row / T)
  indexer: float = 0.0  # DeepSeek V3.2's lightning indexers: projections and index scores, forward only


class ForwardCount(NamedTuple):
  """What one token computes in one forward pass, read off a built model."""

  active: float  # base weights of every projection but the logits head (MoE: k of E experts)
  adapters: int  # LoRA adapters (nnx.LoRAParam), each used once per token
  logits: float  # the logits head's weights x its applications (1 + MTP modules)
  attention: float  # forward QK^T + AV FLOPs per token, summed over the attention layers
  vision: float = 0.0  # use_multimodal: forward FLOPs of the vision tower per image (its flops_per_image)
  indexer: float = 0.0  # forward FLOPs per token of the lightning indexers (Indexer.forward_flops_per_token)


def attended_keys(length: int, sliding_window: int = 0, chunk_window: int = 0) -> float:
  """Mean keys per query of causal attention over `length` positions (0 windows: global).

  The continuous (area) count: a causal [T, T] score matrix is T^2/2 (MaxText's convention: half of full
  attention), a band of width S < T below the diagonal T*S - S^2/2. Chunked attention (queries see only
  their own block of C places, Llama 4) is that count within each block: T // C blocks of C and one of
  T % C. Per query: T/2 for a global layer, S - S^2/(2T) for a sliding window.
  """

  def per_query(block: int) -> float:  # mean keys per query of one causal block
    s = block if sliding_window <= 0 else min(sliding_window, block)
    return s - s * s / (2.0 * block)

  chunk = length if chunk_window <= 0 else min(chunk_window, length)
  full, rest = divmod(length, chunk)
  if not rest:  # every block alike (one block when global or sliding)
    return per_query(chunk)
  return (full * chunk * per_query(chunk) + rest * per_query(rest)) / length


def _size(param: nnx.Variable) -> int:
  return math.prod(param.get_value().shape)


def _copies(dense: DenseGeneral) -> int:
  """The layers a projection stands for: its kernel's leading stacked-layer dims (scan_layers), else 1."""
  return _size(dense.kernel) // math.prod(dense.in_features + dense.out_features)


def _attention_forward(module: Attention | MLAttention, length: int) -> float:
  """Forward QK^T + AV FLOPs per token: 2 per multiply-add, over N heads, H_qk + H_v dims, the attended keys."""
  heads, v_dims = module.out.in_features  # [N, H_v] -> D
  query = module.query if getattr(module, "wq_b", None) is None else module.wq_b  # MLA with q_lora_rank
  if getattr(module, INDEXER, None) is not None:  # V3.2: a dense [T, S] mask (causal & top-k), every key computed
    keys = float(length)
  else:
    keys = attended_keys(length, module.sliding_window, getattr(module, "chunk_window", 0))
  qk_dims = getattr(module, "qk_head_dim", None) or query.out_features[-1]  # qwen3next: q and gate share a projection
  return 2.0 * keys * heads * (qk_dims + v_dims) * _copies(module.out)


def forward_count(model: nnx.Module, length: int) -> ForwardCount:
  """Walk `model` (a Decoder, abstract or real) for a training length of `length` tokens."""
  active = attention = indexer = 0.0
  for path, module in nnx.iter_modules(model):
    if path[:1] == (VISION,):  # per image, not per token: vision_forward_per_image
      continue
    if isinstance(module, Indexer):  # its projections too: forward only, and only when it selects
      indexer += module.forward_flops_per_token(length) * _copies(module.wk)
    elif isinstance(module, DenseGeneral) and path != (LOGITS_HEAD,) and INDEXER not in path:
      active += _size(module.kernel)
    elif isinstance(module, MoeBlock):
      active += sum(_size(getattr(module, w)) for w in EXPERT_WEIGHTS) * module.k / module.num_experts
    elif isinstance(module, (Attention, MLAttention)):
      attention += _attention_forward(module, length)
    elif isinstance(module, GatedDeltaNet):  # linear attention: per token, independent of the length
      attention += module.forward_flops_per_token() * _copies(module.out)
  head = getattr(model, LOGITS_HEAD)
  head_size = _size(model.token_embedder.embedding if head is None else head.kernel)
  applications = 1 + len(model.mtp_modules or ())  # each MTP module applies the shared head again
  adapters = nnx.state(model, nnx.LoRAParam)  # the text model's: a trained tower's are in its per-image count
  adapters = sum(x.size for key, sub in adapters.items() if key != VISION for x in jax.tree.leaves(sub))
  vision = getattr(model, VISION, None)
  if vision is None:
    per_image = 0.0
  elif hasattr(vision, "flops_per_image"):  # a tower that counts itself (Llama 4's)
    per_image = vision.flops_per_image()
  else:  # Gemma 3's SigLIP tower and projector
    per_image = vision_forward_per_image(model)
  return ForwardCount(active, adapters, head_size * applications, attention, per_image, indexer)


def vision_forward_per_image(model: nnx.Module) -> float:
  """Forward FLOPs of one image through the vision tower and projector (0 without one): every SigLIP
  projection (patch embedding, q/k/v/o, MLP) once per patch, full attention over the P patches
  (QK^T and AV: 4·P·P·width per layer), the projector once per soft token."""
  encoder = getattr(model, VISION, None)
  if encoder is None:
    return 0.0
  patches, tokens = encoder.patches_per_side**2, encoder.tokens_per_side**2
  per_patch = sum(
    _size(m.kernel)
    for p, m in nnx.iter_modules(encoder)
    if isinstance(m, DenseGeneral) and p[:1] != ("mm_input_projection",)
  )
  width = encoder.position_embedding.get_value().shape[-1]
  attention = 4.0 * patches * patches * width * encoder.num_layers
  return 2.0 * per_patch * patches + attention + 2.0 * _size(encoder.mm_input_projection.kernel) * tokens


def abstract_model(config: Config, spec: state_lib.StateSpec | None = None) -> nnx.Module:
  """The model train builds for `config`, abstract (nothing allocated): from the `spec` a run already has,
  else from state.param_spec."""
  if spec is not None:
    return nnx.merge(spec.graphdef, spec.abstract.params)
  params = state_lib.param_spec(config)
  return nnx.merge(params.graphdef, params.abstract)


def training_flops_per_token(config: Config, model: nnx.Module | None = None) -> FlopCount:
  """Model FLOPs per trained token, forward + backward (3x the forward): the standard 6·N count.

  `model`: the built model (abstract is enough: nnx.merge(spec.graphdef, spec.abstract)); None builds it
  abstractly from `config`. Every weight matmul costs 2 FLOPs per weight per token forward and 4 backward
  (activation and weight gradients), 6 in all, for the weights a token actually multiplies by:
    matmul    = 6 · every projection (DenseGeneral kernel) but the logits head: attention q/k/v/o or MLA's,
                MLPs, MoE routers and shared experts, MTP eh_proj; + 6 · k/E of each MoeBlock's experts
    embedding = 6·D·V per logits application (tied or not; the main head and one per MTP module); the
                input lookup is not a matmul
    attention = 3 · sum over attention layers 2·S_eff·N·(H_qk + H_v)
                QK^T and AV, 2 FLOPs per multiply-add, over S_eff = attended_keys(T, window, chunk) keys:
                T/2 for global causal layers (half of full attention, as MaxText counts it), less for
                sliding-window and chunked layers; MLA's H_qk is qk_nope + qk_rope, H_v is v_head_dim;
                + 3 · per gated DeltaNet layer its chunked-rule and convolution FLOPs per token (qwen3next),
                which do not grow with T; MLA with a lightning indexer (V3.2) attends through a dense mask
                (causal & each query's top index_topk keys): all T keys per query are computed, twice the
                causal T/2 (the top-k ideal, min(t, index_topk) keys for query t, is attended_keys(T, index_topk))
    indexer   = 1 · per V3.2 layer its forward: 2 · (wq_b + wk + weights_proj weights) + 2·T·H_idx·(I_idx + 1)
                (q.k scores over all T keys and their head-weighted sum); 0 when T <= index_topk (no selection).
                Forward only: the top-k indices pass no gradient to the indexer
  Under LoRA the base is frozen: the backward still computes activation gradients through its weights but
  no weight gradients, so every base weight (matmul and embedding) costs 4, not 6; the adapters, trained
  and each used once per token, cost 6 each and are counted in matmul. Not counted: norms, activations,
  softmax, RoPE, biases, the MoE dispatch (XLA's cost analysis does count them).
    vision    = slots / T · vision_forward_per_image (one image or tile; slots: image_tiles_per_row, else
                images_per_row), x1 with freeze_vision_encoder (no backward reaches the tower), else x3, or x2
                under LoRA (adapted tower: activation gradients only; its small adapters not counted)
                (use_multimodal; the image tokens' text-model work is in the rest)
  """
  model = abstract_model(config) if model is None else model
  w = forward_count(model, config.max_target_length)
  per_weight = 4.0 if w.adapters else 6.0  # LoRA: no weight gradients for the frozen base
  matmul = per_weight * w.active + 6.0 * w.adapters
  attention = 3.0 * w.attention
  embedding = per_weight * w.logits
  # The vision tower runs once per image slot of a row: its forward, and its backward (2x) unless
  # freeze_vision_encoder keeps it fixed (no gradient flows into it then).
  slots = config.image_tiles_per_row or config.images_per_row  # tiles per row (data/images.slots_per_row)
  passes = 1.0 if config.freeze_vision_encoder else (2.0 if config.lora_rank > 0 else 3.0)
  vision = passes * w.vision * slots / config.max_target_length
  total = matmul + attention + embedding + vision + w.indexer  # the indexer: forward only (no gradient reaches it)
  return FlopCount(total, matmul, attention, embedding, vision, w.indexer)


def mfu(flops_per_step: float, step_time_s: float, num_devices: int, peak_flops_per_device: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak (a fraction)."""
  return flops_per_step / step_time_s / num_devices / peak_flops_per_device


def main(argv: list[str]) -> None:
  """python3 -m MaxText.flops CONFIG.yml [key=value ...]: the training FLOPs per token of that model."""
  flops = training_flops_per_token(config_lib.load(argv[1:]))
  print(f"training FLOPs per token: {flops.total:.4g} ({flops._asdict()})")


if __name__ == "__main__":
  main(sys.argv)
