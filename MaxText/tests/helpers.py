"""Helpers that several test modules share beyond conftest.py's tiny config and fixtures: tiny Hugging Face
models of each family and their conversion, the decode families, a chat tokenizer, LoRA tree views, train.py in
a watched subprocess, the GRPO command line, the two-process data run. Test modules import from here or from
conftest.py, never from each other (structure_test checks it). The tiny Hugging Face models and their outputs
are committed under hf_references/ (hf_model reads them, no torch needed); torch and transformers are imported
where used, in `torch`-marked tests only."""

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText import checkpointing, config, models, planner, preemption, sharding
from MaxText.convert import hf_to_maxtext, mappings, maxtext_to_hf
from MaxText.data import make_iterators
from MaxText.data import tokenizer as tokenizers
from MaxText.inference import engine
from MaxText.tests.conftest import BASE, ROOT, TINY, cpu_subprocess_env

# Hugging Face parity: tiny random models of each family (families_test, decode_parity_test, ...).
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SMALL |= dict(vocab_size=64, head_dim=8, tie_word_embeddings=False)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA31_ROPE |= {"original_max_position_embeddings": 8, "rope_theta": 500000.0}
GEMMA3_ROPE = {
  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
DEEPSEEK = dict(num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, moe_intermediate_size=16)
DEEPSEEK |= dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1)
DEEPSEEK |= dict(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6, head_dim=4)
# YaRN over 8 rope dims: with these lengths the 4 frequencies are scaled by 1, 0.625, 0.25, 0.25 (truncate) or
# 1, 0.256, 0.25, 0.25; mscale != mscale_all_dim scales cos/sin, mscale_all_dim the MLA softmax.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
DEEPSEEK_YARN = dict(DEEPSEEK, qk_rope_head_dim=8, head_dim=8, max_position_embeddings=256)
DEEPSEEK2 = dict(DEEPSEEK_YARN, topk_method="group_limited_greedy", rope_parameters={**YARN, "mscale": 0.9})
DEEPSEEK2["rope_parameters"] |= {"mscale_all_dim": 0.7}
DEEPSEEK2_LITE = dict(DEEPSEEK2, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1)
DEEPSEEK2_LITE["rope_parameters"] = {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": False}
DEEPSEEK3_YARN = dict(DEEPSEEK_YARN, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16})
# Kimi K2's YaRN: beta_fast = beta_slow = 1, mscale = mscale_all_dim = 1. Over these 8 rope dims the equal betas
# keep frequencies 0-1 and divide 2-3 by factor (the default betas ramp frequency 1 to 0.625); one expert group.
KIMI_ROPE = {**YARN, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
KIMI_K2 = dict(DEEPSEEK_YARN, n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_parameters=KIMI_ROPE)
# DeepSeek V3.2: the indexer keeps 4 of up to T keys per query, so its selection acts.
DEEPSEEK32 = dict(DEEPSEEK, index_n_heads=16, index_head_dim=8, index_topk=4)
# Llama 4: 6 layers = one scanned block of 4 (layer 3 NoPE; layers 1, 3 MoE) and a remainder of 2; chunks of 4
# and temperature steps every 4 positions, so both act within T tokens; llama3 RoPE scaling as Scout's.
LLAMA4 = dict(num_hidden_layers=6, intermediate_size=16, intermediate_size_mlp=48, num_local_experts=4)
LLAMA4 |= dict(interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=4, attn_scale=1.0)
LLAMA4 |= dict(rope_parameters=LLAMA31_ROPE, max_position_embeddings=64)
# GLM-4.5: q/k/v biases, q/k norms, RoPE on half of each head (transformers' default), a dense first layer, then
# sigmoid routing with a selection bias in groups, scaled, plus a shared expert.
GLM45 = dict(num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8)
GLM45 |= dict(num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)
GLM45 |= dict(attention_bias=True, use_qk_norm=True)
# OLMo 3: 5 layers = one scanned block (3 sliding, 1 full) and a remainder of 1; YaRN on the full layer only,
# another RoPE base on the sliding ones; a window of 4 acts within T tokens.
OLMO3_ROPE = {"full_attention": YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
OLMO3 = dict(num_hidden_layers=5, sliding_window=4, rope_parameters=OLMO3_ROPE, max_position_embeddings=256)
# MiniMax M2: every layer a sigmoid-routed MoE with a selection bias; q/k norms over all heads; RoPE on 4 of 8 dims.
MINIMAX_M2 = dict(num_local_experts=4, num_experts_per_tok=2, rotary_dim=4, bos_token_id=1, eos_token_id=2)
# Qwen3.5-MoE: 5 layers = one scanned block of 4 (3 gated DeltaNet, 1 gated attention) and a remainder of 1;
# 2 key heads serving 4 value heads; half the head dims rotated.
QWEN35 = dict(num_hidden_layers=5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
QWEN35 |= dict(shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4)
QWEN35 |= dict(linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, max_position_embeddings=64)
QWEN35 |= dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
# Dense Qwen3.5: the same stack with a gated MLP (intermediate_size) in every layer.
QWEN35_DENSE = {k: v for k, v in QWEN35.items() if "expert" not in k and k != "moe_intermediate_size"}
# Gemma 4: 4 layers = one scanned block (sliding, full) of 2 repeats; the full layers with head dim 16, one kv head,
# no v_proj (K = V) and proportional RoPE on a quarter of their dims; a window of 4 acts within T tokens.
# GEMMA4_KV_SHARED (gemma4_test): 6 layers = one scanned cycle, then one unit of a cycle and 2 kv-sharing layers with
# double-wide MLPs (transformers 5.23 runs kv-sharing without per-layer embeddings only with output_hidden_states).
GEMMA4_ROPE = {
  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 10000.0},
  "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}
GEMMA4 = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4)
GEMMA4 |= dict(global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0)
GEMMA4 |= dict(final_logit_softcapping=3.0, rope_parameters=GEMMA4_ROPE, hidden_activation="gelu_pytorch_tanh")
FAMILIES = {
  "llama2": ("LlamaConfig", {}),
  "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
  "llama3.1": ("LlamaConfig", {"rope_parameters": LLAMA31_ROPE, "max_position_embeddings": 64}),
  "mistral": ("MistralConfig", {"sliding_window": 4}),
  "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
  "qwen3": ("Qwen3Config", {}),
  "gemma": ("GemmaConfig", {"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"}),
  "gemma2": (
    "Gemma2Config",
    {"sliding_window": 4, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 6},
  ),
  "gemma3": (
    "Gemma3TextConfig",
    {"num_hidden_layers": 7, "sliding_window": 4, "rope_parameters": GEMMA3_ROPE, "query_pre_attn_scalar": 6},
  ),
  "deepseek3": ("DeepseekV3Config", DEEPSEEK),
  "deepseek-no-q-lora": ("DeepseekV3Config", {**DEEPSEEK, "q_lora_rank": None, "n_group": 1, "topk_group": 1}),
  "deepseek3-yarn": ("DeepseekV3Config", DEEPSEEK3_YARN),
  "kimi-k2": ("DeepseekV3Config", KIMI_K2),
  "deepseek32": ("DeepseekV32Config", DEEPSEEK32),
  "deepseek2": ("DeepseekV2Config", DEEPSEEK2),
  "deepseek2-lite": ("DeepseekV2Config", DEEPSEEK2_LITE),
  "llama-yarn": ("LlamaConfig", {"rope_parameters": YARN, "max_position_embeddings": 256}),
  "gpt3": ("GPT2Config", {}),
  "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
  "llama4": ("Llama4TextConfig", LLAMA4),
  "glm4_moe": ("Glm4MoeConfig", GLM45),
  "olmo3": ("Olmo3Config", OLMO3),
  "minimax-m2": ("MiniMaxM2Config", MINIMAX_M2),
  "qwen3.5-moe": ("Qwen3_5MoeTextConfig", QWEN35),
  "qwen3.5": ("Qwen3_5TextConfig", QWEN35_DENSE),
  "gemma4": ("Gemma4TextConfig", GEMMA4),
}
GEMMA4_KV_SHARED = dict(GEMMA4, num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
GEMMA4_KV_SHARED |= dict(num_kv_shared_layers=2, use_double_wide_mlp=True)
# "gemma4-ple": GEMMA4_KV_SHARED with per-layer embeddings of width 4 (the layout of the E2B/E4B models)
FAMILIES["gemma4-ple"] = (
  "Gemma4TextConfig",
  dict(GEMMA4_KV_SHARED, hidden_size_per_layer_input=4, vocab_size_per_layer_input=64),
)
# "gemma4-moe": GEMMA4 with the MoE block beside each dense MLP: 4 experts of width 16, top 2 (router scale and
# per-expert scales randomised by make.py)
FAMILIES["gemma4-moe"] = (
  "Gemma4TextConfig",
  dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
)
GPT2 = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, n_inner=48)  # 32: prompt + 16 new
T = 12
TOKENS = np.random.default_rng(0).integers(0, 64, (2, T))  # the references' logits are on these
PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6, 53], [40, 41, 42, 43, 44, 45]]
PARITY_NEW = 16
# Config changes for the references' greedy tokens only (the same weights): transformers counts llama4's
# temperature-tuning positions from the left padding (the prompt alone would differ), so there its steps start
# beyond the 32 positions; families_test checks the scaling itself on the logits.
HF_DECODE = {"llama4": {"floor_scale": 64}}
HF_REFERENCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_references")


# The tiny models of tests beyond FAMILIES (gpt_oss_test, qwen3next_test), with the way make.py randomises them.
# gpt-oss: YaRN as it ships (truncate false) over 8 rope dims and a short pre-training length, so it scales
# frequencies; 3 layers = one scanned sliding/full pair and a sliding remainder; windows of 4 act within T;
# swiglu_limit 1.5 so the clamps act on these random weights.
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}
GPT_OSS_YARN |= {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
GPT_OSS = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
GPT_OSS |= dict(head_dim=8, vocab_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
GPT_OSS |= dict(swiglu_limit=1.5, rope_parameters=GPT_OSS_YARN, max_position_embeddings=32, tie_word_embeddings=False)
# Qwen3-Next: 5 layers = one scanned block of 4 (layers 0-2 gated DeltaNet, 3 gated attention) and a remainder
# of 1; 2 key heads serving 4 value heads; half the head dims rotated.
QWEN3NEXT = dict(hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
QWEN3NEXT |= dict(vocab_size=64, tie_word_embeddings=False, intermediate_size=48, full_attention_interval=4)
QWEN3NEXT |= dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6)
QWEN3NEXT |= dict(linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
QWEN3NEXT |= dict(shared_expert_intermediate_size=16, partial_rotary_factor=0.5, max_position_embeddings=64)
# name: (transformers config class, its arguments, init). Inits (hf_references/make.py): "norms" (FAMILIES: norms,
# biases and selection biases random), "all" (every weight random; norms around 1), "all-bf16" (the same,
# rounded to bfloat16, so a bfloat16 export is exact), "zero-centred" (norms around 0, the DeltaNet's around 1).
HF_EXTRA = {
  "gpt-oss": ("GptOssConfig", GPT_OSS, "all"),
  "gpt-oss-bf16": ("GptOssConfig", GPT_OSS, "all-bf16"),
  "qwen3-next": ("Qwen3NextConfig", QWEN3NEXT, "zero-centred"),
}


def hf_reference_names():
  """Every model with a committed reference: FAMILIES and HF_EXTRA."""
  return sorted([*FAMILIES, *HF_EXTRA])


def hf_entry(name):
  """What the reference `name` is made from: {"class", "kwargs" (the transformers config arguments), "init",
  "decode" (HF_DECODE's changes for the greedy tokens)}, as reference.json stores it."""
  if name in HF_EXTRA:
    cls, kwargs, init = HF_EXTRA[name]
  else:
    (cls, extra), init = FAMILIES[name], "norms"
    kwargs = {**GPT2} if name == "gpt3" else {**SMALL, **extra}
  return json.loads(json.dumps({"class": cls, "kwargs": kwargs, "init": init, "decode": HF_DECODE.get(name, {})}))


class HFReference:
  """A committed reference's outputs: logits [2, T, 64] on TOKENS and greedy tokens [3, PARITY_NEW] on PROMPTS
  (written by hf_references/make.py with transformers)."""

  def __init__(self, family):
    from safetensors import numpy as safetensors_numpy

    self.family = family
    tensors = safetensors_numpy.load_file(os.path.join(HF_REFERENCES, family, "reference.safetensors"))
    self.logits, self.greedy = tensors["logits"], tensors["greedy"]


def hf_model(family, tmp_path, vocab_size=None):
  """(The committed tiny random HF model's reference outputs, a copy of its files under tmp_path/hf); vocab_size
  widens its vocabulary (new embedding and head rows random; the reference outputs then no longer apply)."""
  from safetensors import numpy as safetensors_numpy

  source = os.path.join(HF_REFERENCES, family)
  made = json.load(open(os.path.join(source, "reference.json")))
  assert made == hf_entry(family), f"{family}: its entry differs from hf_references/; run make.py {family}"
  path = os.path.join(tmp_path, "hf")
  os.makedirs(path, exist_ok=True)
  for name in os.listdir(source):
    if not name.startswith("reference."):
      shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
  if vocab_size is not None:
    weights = os.path.join(path, "model.safetensors")
    tensors = safetensors_numpy.load_file(weights)
    rng = np.random.default_rng(0)
    for name, w in tensors.items():
      if name.endswith(("embed_tokens.weight", "lm_head.weight", "wte.weight")):
        extra = rng.normal(0.0, float(w.std()), (vocab_size - w.shape[0], *w.shape[1:])).astype(w.dtype)
        tensors[name] = np.concatenate([w, extra])
    safetensors_numpy.save_file(tensors, weights, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "vocab_size": vocab_size}, open(os.path.join(path, "config.json"), "w"))
  return HFReference(family), path


def maxtext_logits(out_dir, tokens, *overrides):
  """Float32 logits [B, T, V] of the converted model in out_dir on tokens [B, T]."""
  return np.asarray(forward(load_converted(out_dir, *overrides), jnp.asarray(tokens)))


def forward(model, tokens, segments=None, positions=None):
  """model's logits on tokens [B, T] (one segment, positions 0..T-1 unless given), as one compiled program."""
  b, t = tokens.shape
  segments = jnp.ones((b, t), jnp.int32) if segments is None else segments
  positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
  return _call(model, tokens, positions, segments)


@nnx.jit  # one compile per model; op by op, each of its small ops outside the layer scan compiles alone
def _call(model, tokens, positions, segments):
  return model(tokens, positions, segments)


def assert_live_model_converts(model, tmp_path) -> None:
  """A live transformers model (an image-text one included), its norms randomised about 1, saved and converted:
  our logits on random text tokens [2, T] equal its own (torch tier)."""
  import torch

  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.randn_like(p) * 0.5 + 1.0)
  hf_path, out = str(tmp_path / "hf"), str(tmp_path / "mt")
  model.save_pretrained(hf_path)
  tokens = np.random.default_rng(0).integers(0, 64, (2, T))
  with torch.no_grad():
    want = model(input_ids=torch.tensor(tokens)).logits.numpy()
  from MaxText.convert import hf_to_maxtext

  hf_to_maxtext.convert(hf_path, out)
  np.testing.assert_allclose(maxtext_logits(out, tokens), want, rtol=1e-5, atol=1e-5)


def assert_export_is_exact(c: config.Config, hf_path: str, back: str) -> None:
  """Export the model `c` loads to Hugging Face at `back`: every tensor equals hf_path's original, bit for bit."""
  from safetensors import numpy as safetensors_numpy

  maxtext_to_hf.convert(c, back)
  original = safetensors_numpy.load_file(os.path.join(hf_path, "model.safetensors"))
  exported = exported_tensors(back)
  assert sorted(exported) == sorted(original)
  for name, tensor in original.items():
    assert exported[name].dtype == tensor.dtype and np.array_equal(exported[name], tensor), name


def exported_tensors(back: str) -> dict:
  """Every tensor of the Hugging Face export in `back` (all its safetensors shards), by name, as numpy arrays."""
  from safetensors import numpy as safetensors_numpy

  exported = {}
  for name in set(json.load(open(os.path.join(back, "model.safetensors.index.json")))["weight_map"].values()):
    exported |= safetensors_numpy.load_file(os.path.join(back, name))
  return exported


# Llama 4 with its vision tower (llama4_vision_test, llama4_images_test).
L4V_TEXT = dict(
  hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4, num_attention_heads=4
)
L4V_TEXT |= dict(num_key_value_heads=2, vocab_size=64, head_dim=8, num_local_experts=4, interleave_moe_layer_step=2)
L4V_TEXT |= dict(
  attention_chunk_size=8, floor_scale=4, attn_scale=1.0, max_position_embeddings=64, tie_word_embeddings=False
)
# 16 x 16 tiles of 4 x 4 patches: a 4 x 4 grid, pixel-shuffled to 4 soft tokens per tile.
L4V_VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16)
L4V_VISION |= dict(
  patch_size=4, pixel_shuffle_ratio=0.5, projector_input_dim=24, projector_output_dim=24, vision_output_dim=24
)
L4V_IMAGE_TOKEN = 63


def built(c: config.Config, plan, seed: int = 0) -> nnx.Module:
  """models.build(c, nnx.Rngs(params=seed), plan) as one compiled program, bit for bit the same parameters: eagerly,
  each parameter's initializer compiled on its own (a tiny DeepSeek's build took 14 s, not 5)."""
  return nnx.jit(lambda: models.build(c, nnx.Rngs(params=seed), plan))()


def load_converted(out_dir, *overrides):
  c = config.load([os.path.join(out_dir, "config.yml"), "run_name=t", "dtype=float32", *overrides], {})
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.build(c, nnx.Rngs(0), planner.build(c))), nnx.Param)
  return nnx.merge(graphdef, checkpointing.load_params(os.path.join(out_dir, "params"), abstract))


def hf_greedy(model, prompts):
  import torch

  width = max(len(p) for p in prompts)
  ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = model.generate(ids, attention_mask=mask, max_new_tokens=PARITY_NEW, do_sample=False, pad_token_id=0)
  return out[:, width:].numpy()


# Decoding: the families of decode_test (MaxText command-line overrides).
DECODE_TINY = ["base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=48", "head_dim=8"]
DECODE_TINY += ["base_num_decoder_layers=2", "vocab_size=64", "max_target_length=32", "dtype=float32", "run_name=t"]
DECODE_TINY += ["max_prefill_predict_length=16", "enable_checkpointing=false"]
GEMMA = ["logits_via_embedding=true", "mlp_activations=[gelu,linear]"]
SOFT_CAPS = ["attn_logits_soft_cap=5.0", "final_logits_soft_cap=3.0", "query_pre_attn_scalar=6"]
DECODE_FAMILIES = {
  "llama2": [],
  "llama-bias": ["attention_bias=true", "mlp_bias=true"],
  "mistral": ["decoder_block=mistral", "sliding_window_size=3"],
  "mixtral": ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"],
  "qwen3": ["decoder_block=qwen3", "use_qk_norm=true"],
  "gemma": ["decoder_block=gemma", *GEMMA],
  "gemma2": ["decoder_block=gemma2", "base_num_decoder_layers=3", "sliding_window_size=3", *GEMMA, *SOFT_CAPS],
  "gemma3": ["decoder_block=gemma3", "base_num_decoder_layers=7", "sliding_window_size=3", "use_qk_norm=true"]
  + ["rope_type=linear", *GEMMA, "use_post_attn_norm=true", "use_post_ffw_norm=true"],
  "deepseek": ["decoder_block=deepseek", "base_num_decoder_layers=3", "first_num_dense_layers=1", "num_experts=4"]
  + ["num_experts_per_tok=2", "shared_experts=1", "q_lora_rank=12", "kv_lora_rank=8", "qk_nope_head_dim=6"]
  + ["qk_rope_head_dim=4", "v_head_dim=6", "routed_score_func=sigmoid", "n_routing_groups=2", "routed_bias=true"],
  # DeepSeek V3.2: the indexer keeps 3 of up to 12 keys per query (prefill and cached steps).
  "deepseek32": ["decoder_block=deepseek", "base_num_decoder_layers=2", "first_num_dense_layers=1", "num_experts=4"]
  + ["q_lora_rank=12", "kv_lora_rank=8", "qk_nope_head_dim=6", "qk_rope_head_dim=4", "v_head_dim=6"]
  + ["index_n_heads=16", "index_head_dim=8", "index_topk=3"],
  "gpt3": ["decoder_block=gpt3", "mlp_activations=[gelu]", "logits_via_embedding=true", "use_iota_embed=true"]
  + ["trainable_position_size=32"],
  "glm4_moe": ["decoder_block=glm4_moe", "base_num_decoder_layers=3", "first_num_dense_layers=1", "num_experts=4"]
  + ["num_experts_per_tok=2", "shared_experts=1", "routed_score_func=sigmoid", "n_routing_groups=2", "routed_bias=true"]
  + ["attention_bias=true", "use_qk_norm=true", "partial_rotary_factor=0.5", "routed_scaling_factor=2.5"],
  "olmo3": ["decoder_block=olmo3", "base_num_decoder_layers=5", "sliding_window_size=3", "use_qk_norm=true"]
  + ["rope_type=yarn", "rope_factor=4.0", "original_max_position_embeddings=8", "local_rope_max_timescale=1000"],
  "minimax-m2": ["decoder_block=minimax_m2", "num_experts=4", "num_experts_per_tok=2", "use_qk_norm=true"]
  + ["routed_score_func=sigmoid", "routed_bias=true", "partial_rotary_factor=0.5"],
  "qwen3_5": ["decoder_block=qwen3_5", "full_attention_interval=2", "num_experts=4", "num_experts_per_tok=2"]
  + ["base_moe_mlp_dim=16", "shared_experts=1", "shared_expert_gate=true", "linear_num_key_heads=2"]
  + ["linear_num_value_heads=4", "linear_key_head_dim=8", "linear_value_head_dim=6", "linear_chunk_size=4"]
  + ["partial_rotary_factor=0.5", "use_qk_norm=true"],
  "gemma4": ["decoder_block=gemma4", "base_num_decoder_layers=4", "full_attention_interval=2", "sliding_window_size=3"]
  + ["global_head_dim=16", "global_num_kv_heads=1", "attention_k_eq_v=true", "rope_type=proportional"]
  + ["partial_rotary_factor=0.25", *GEMMA, "use_post_attn_norm=true", "use_post_ffw_norm=true", "use_qk_norm=true"]
  + ["final_logits_soft_cap=3.0"],
  # its last 2 of 6 layers sharing the keys/values of layers 2 (sliding) and 3 (full), with double-wide MLPs, and
  # per-layer embeddings
  "gemma4-kv-shared": ["decoder_block=gemma4", "base_num_decoder_layers=6", "full_attention_interval=2"]
  + ["hidden_size_per_layer_input=4", "vocab_size_per_layer_input=64"]
  + ["sliding_window_size=3", "num_kv_shared_layers=2", "use_double_wide_mlp=true", "global_head_dim=16"]
  + ["global_num_kv_heads=1", "attention_k_eq_v=true", "rope_type=proportional", "partial_rotary_factor=0.25", *GEMMA]
  + ["use_post_attn_norm=true", "use_post_ffw_norm=true", "use_qk_norm=true"],
}
# gemma4 with the MoE block beside each dense MLP: 4 experts of width 16, top 2
DECODE_FAMILIES["gemma4-moe"] = [*DECODE_FAMILIES["gemma4"], "num_experts=4", "num_experts_per_tok=2"]
DECODE_FAMILIES["gemma4-moe"] += ["base_moe_mlp_dim=16"]


def assert_cache_equals_forward(*overrides):
  """A tiny model with random parameters: prefill of right-padded rows (5 and 8 tokens) and 4 cached steps give
  the logits of the full forward pass."""
  c = config.load([BASE, *DECODE_TINY, *overrides], {})
  # Random parameters from the shapes: compiling the initialisers costs more than the test (deepseek).
  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: models.build(c, nnx.Rngs(params=0), planner.build(c))), nnx.Param
  )
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.3, a.shape), a.dtype), abstract)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 12)), jnp.int32)
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.ones_like(t)))
  full = forward(params, tokens)
  lengths = jnp.asarray([5, 8])  # rows of different lengths, right-padded
  padded = jnp.where(jnp.arange(8) < lengths[:, None], tokens[:, :8], 0)
  logits, cache = jax.jit(engine.prefill, static_argnums=(0, 1))(graphdef, 16, params, padded, lengths)
  for row, n in enumerate([5, 8]):
    np.testing.assert_allclose(logits[row, :n], full[row, :n], atol=1e-5, rtol=1e-5)
  step = jax.jit(engine.step, static_argnums=0)
  positions = lengths
  for _ in range(4):
    logits, cache = step(graphdef, params, cache, tokens[jnp.arange(2), positions], positions)
    np.testing.assert_allclose(logits, full[jnp.arange(2), positions], atol=1e-5, rtol=1e-5)
    positions = positions + 1


# Chat data (sft_test, dpo_test, the multimodal tests).
CHATML = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEXT = "The capital of France is Paris. What is the capital of France? Hello there, how are you today?\n" * 4


def make_tokenizer(directory, template=CHATML, eos="<|im_end|>"):
  """A byte-level BPE tokenizer.json (~300 ids) with ChatML special tokens and a tokenizer_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  tok.train_from_iterator(
    [CHAT_TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=CHAT_SPECIAL, initial_alphabet=alphabet)
  )
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  cfg = {"bos_token": "<s>", "eos_token": eos, "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}
  if template:
    cfg["chat_template"] = template
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f)
  return tokenizers.load_tokenizer(directory, "huggingface")


def tiktoken_file(path):
  """A tiny Llama 3 style tiktoken ranks file at `path` (a pathlib.Path): the 256 bytes, then a few merges."""
  import base64

  pieces = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"re", b"ur", b"urn"]
  path.write_text("".join(f"{base64.b64encode(p).decode()} {rank}\n" for rank, p in enumerate(pieces)))
  return str(path)


def write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  return str(path)


def sft_config(tmp_path, tok, data, *overrides):
  tok_args = ["tokenizer_type=huggingface", f"tokenizer_path={tok.path}"]
  args = [BASE, "run_name=sft", f"base_output_directory={tmp_path}", *TINY, "dataset_type=text", "use_sft=true"]
  return config.load([*args, f"dataset_path={data}", *tok_args, "vocab_size=320", "eval_fraction=0", *overrides], {})


# LoRA (lora_test, multimodal_data_test).
LORA = ["lora_rank=4", "lora_alpha=8", "per_device_batch_size=1", "learning_rate=3e-2"]


def converted_lora_chat_sft(family, tmp_path):
  """The config of 4 LoRA steps of chat SFT on a converted tiny `family` (its committed model, the vocabulary
  widened to the chat tokenizer's 320), single-row chat data, float32."""
  _, hf_path = hf_model(family, tmp_path, vocab_size=320)
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  tok = make_tokenizer(tmp_path / "tok")
  data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "What is the capital of France?", "completion": "Paris."}])
  return config.load(
    [os.path.join(out, "config.yml"), "run_name=sft", f"base_output_directory={tmp_path}", "use_sft=true"]
    + ["dataset_type=text", f"dataset_path={data}", "tokenizer_type=huggingface", f"tokenizer_path={tok.path}"]
    + [f"load_parameters_path={out}/params", "eval_fraction=0", "steps=4", "max_target_length=32", "dtype=float32"]
    + [*LORA, "enable_checkpointing=false", "log_config=false", "log_period=1", "warmup_steps_fraction=0"],
    {},
  )


def learnable_batch(c, seed=0):
  """A fixed learnable batch [8, T]: each target is its input + 1."""
  tokens = np.random.default_rng(seed).integers(0, c.vocab_size, (8, c.max_target_length), dtype=np.int32)
  ones = np.ones_like(tokens)
  positions = np.broadcast_to(np.arange(c.max_target_length, dtype=np.int32), tokens.shape)
  return {
    "inputs": tokens,
    "targets": (tokens + 1) % c.vocab_size,
    "inputs_segmentation": ones,
    "targets_segmentation": ones,
    "inputs_position": positions,
  }


def host_tree(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def leaves_equal(a, b):
  """Per leaf: bitwise equal."""
  return [np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]


def leaf_names(tree):
  return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)}


# train.py in a subprocess, watched line by line (faults_test, goodput_test, rl_faults_test).
FAULTS_RUN = ["per_device_batch_size=1", "hardware=cpu", "enable_checkpointing=true", "steps=200"]
NO_TRACE = ("Traceback", "Check failure", "Segmentation")


class Process:
  """train.py (or any command) in a subprocess whose combined output is read line by line as it comes."""

  def __init__(self, command, env):
    self.proc = subprocess.Popen(
      command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    self.lines, self._queue = [], queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      self._queue.put(line)
    self._queue.put(None)

  def wait_for(self, text, timeout=180):
    """Read output until a line contains `text`; fails on end of output or timeout."""
    deadline = time.monotonic() + timeout
    while True:
      line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
      assert line is not None, f"ended before {text!r}:\n" + "".join(self.lines[-30:])
      self.lines.append(line)
      if text in line:
        return line

  def finish(self, timeout=180):
    """(exit status, the whole output)."""
    self.proc.wait(timeout=timeout)
    while (line := self._queue.get(timeout=30)) is not None:
      self.lines.append(line)
    return self.proc.returncode, "".join(self.lines)


def train_command(tmp_path, name, *overrides):
  command = [sys.executable, "-u", "MaxText/train.py", BASE, f"run_name={name}", f"base_output_directory={tmp_path}"]
  return [*command, *TINY, *FAULTS_RUN, *overrides]


def start(tmp_path, name, *overrides, devices=2, rank=None, port=None, compile_cache=True):
  """train.py with the tests' tiny config in a subprocess. It shares the session's compilation cache (conftest.py),
  so that after the first such run the step loads in a fraction of a second; compile_cache=False for a test that
  needs the compile to take its real time (a signal sent during it)."""
  env = cpu_subprocess_env(devices, compile_cache)
  if rank is not None:
    env.update(JAX_COORDINATOR_ADDRESS="127.0.0.1", JAX_COORDINATOR_PORT=str(port), NNODES="2", NODE_RANK=str(rank))
  return Process(train_command(tmp_path, name, *overrides), env)


def compile_command(*overrides, env=None, timeout=900):
  """train_compile.py in a subprocess, for a TPU topology (libtpu on this CPU) or a GPU one: base.yml, then
  `overrides`; `env` adds to this process's environment less its fake CPU device count. It runs nothing."""
  command = [sys.executable, "MaxText/train_compile.py", BASE, "log_config=false", *overrides]
  base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no fake CPU device count here
  env = {**base, "JAX_PLATFORMS": "cpu", **(env or {})}  # compile for TPUs; run nothing on one
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def reported_gib(stdout: str, what: str) -> float:
  """A per-device figure (arguments, temporaries, total) from train_compile's report, in GiB."""
  match = re.search(rf"{what} ([0-9.]+) GiB", stdout)
  assert match, stdout[-2000:]
  return float(match.group(1))


def checkpoints(tmp_path, name):
  path = os.path.join(tmp_path, name, "checkpoints")
  return sorted(int(p) for p in os.listdir(path) if p.isdigit()) if os.path.isdir(path) else []


def stopped_line(output):
  lines = [line for line in output.splitlines() if line.startswith("Stopped at step ")]
  assert len(lines) == 1, output[-3000:]
  return lines[0]


def stopped_step(output):
  return int(stopped_line(output).split()[3].rstrip(":"))


def assert_clean(output):
  assert not any(marker in output for marker in NO_TRACE), output[-3000:]


def terminate_after(run, text):
  """SIGTERM `run` once it printed `text`: it exits 75 with no traceback after saving a checkpoint at the step it
  stopped at, which is returned."""
  run.wait_for(text)
  run.proc.send_signal(signal.SIGTERM)
  rc, output = run.finish()
  assert rc == preemption.EXIT_STOPPED, output[-3000:]
  assert_clean(output)
  assert "SIGTERM received; checkpoint saved to" in stopped_line(output)
  return stopped_step(output)


# GRPO (rl_test, rl_faults_test).
RL_LENGTH = 16  # "<bos>9+9=18<eos>" is 8 tokens
RL_SUMS = [(a, b) for a in range(10) for b in range(10)]


def write_prompts(path, rows=None):
  rows = [{"prompt": f"{a}+{b}="} for a, b in RL_SUMS] if rows is None else rows
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def rl_args(tmp_path, name, *overrides):
  """The tiny model over UTF-8 bytes (no tokenizer file: inference/tokenizer.ByteTokenizer), sampling 3 tokens."""
  prompts = tmp_path / "prompts.jsonl"
  if not prompts.exists():
    write_prompts(prompts)
  return [
    BASE, f"run_name={name}", f"base_output_directory={tmp_path}", *TINY, "vocab_size=264",
    f"max_target_length={RL_LENGTH}", "max_prefill_predict_length=8",
    "decode_sampling_strategy=weighted", "decode_max_new_tokens=3", "num_generations=4", "per_device_batch_size=8",
    "learning_rate=1e-3", f"dataset_path={prompts}", *overrides,
  ]  # fmt: skip


def rl_config(tmp_path, name, *overrides):
  return config.load([*rl_args(tmp_path, name, *overrides), "objective=grpo"], {})


def records(c):
  with open(c.metrics_file) as f:
    return [json.loads(line) for line in f]


# Two processes reading data (data_test runs this in each).
def data_process_main(process_id: int, port: int, out: str, *argv: str) -> None:
  """One of two processes (4 CPU devices each): save the shards of a few text, synthetic and grain batches."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
  assert jax.process_count() == 2 and jax.local_device_count() == 4
  shards = {}

  def record(name, train, steps):
    for step in steps:
      for shard in next(train).get("inputs").addressable_shards:
        shards[f"{name}/{step}/{shard.index[0].start}"] = np.asarray(shard.data)

  for dataset_type in ("text", "synthetic", "grain"):
    cfg = config.load([*argv, *two_process_overrides(dataset_type, out)], environ={})
    train = make_iterators(cfg, sharding.create_mesh(cfg)).train
    fresh = train.get_state()
    record(dataset_type, train, range(3))
    state = train.get_state()  # a collective for grain: every shard's state reaches every process
    if dataset_type == "grain":
      assert len(state["shards"]) == 2 and state["num_shards"] == 2
      if process_id == 0:  # resumed by one process in the test
        (Path(out) / "grain_state.json").write_text(json.dumps(state))
      record("grain", train, range(3, 5))
      # A one-shard state (as one process saves it) resumed by two processes: each reads the one shard.
      assert fresh["shards"][0] == fresh["shards"][1]  # a fresh shard's state does not name the shard
      one = make_iterators(cfg, sharding.create_mesh(cfg)).train
      one.set_state({"num_shards": 1, "shards": fresh["shards"][:1]})
      record("grain1", one, range(3))
  np.savez(os.path.join(out, f"{process_id}.npz"), **shards)
  jax.distributed.shutdown()


def two_process_overrides(dataset_type: str, out: str) -> list[str]:
  """grain reads DOCS from ArrayRecord files with the tokenizer the text run trained, one document per row."""
  if dataset_type != "grain":
    return [f"dataset_type={dataset_type}"]
  model = os.path.join(out, "t", "tokenizer", "tokenizer.model")
  grain = ["dataset_type=grain", f"grain_train_files={out}/records/*", f"tokenizer_path={model}", "packing=false"]
  return [*grain, "grain_worker_count=0"]


def end_to_end_script(name: str):
  """The module of end_to_end/cpu/<name>.py (the fixture makers), loaded from its file without touching sys.path."""
  import importlib.util  # noqa: PLC0415

  path = os.path.join(os.path.dirname(__file__), "..", "..", "end_to_end", "cpu", f"{name}.py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def hf_keys(hf):
  """config.json -> MaxText keys, through the mapping of its model_type (models.hf_mapping_of)."""
  return mappings.of_config_json(hf).maxtext_keys(hf)


def hf_config(c, dtype):
  """MaxText config -> config.json, through the mapping of its decoder_block (models.hf_mapping)."""
  return mappings.of_block(c.decoder_block).hf_config(c, dtype)


# Images through transformers' image processors, committed in hf_references/processors/pixels.safetensors
# (make_processors.py writes it with transformers; tests compare data/images.py with it, no torch needed).
ODD_SHAPES = [(37, 53), (300, 201), (53, 37), (7, 30)]
L4_GRIDS = [(16, 16), (16, 32), (32, 16), (7, 30), (20, 13), (33, 17), (50, 50)]  # llama4_images_test's tile cases
PROCESSED = [  # (processor, tile size, max tiles (llama4), height, width, seed, style): tiny tiles only
  *[("gemma3", 16, 0, h, w, 0, "random") for h, w in ODD_SHAPES],
  *[("llama4", 16, 4, h, w, 2, "random") for h, w in ODD_SHAPES],
  *[("llama4", 16, 4, h, w, 0, "smooth") for h, w in L4_GRIDS],
  *[("gemma3", 16, 0, h, w, 1, "smooth") for h, w in [(16, 16), (20, 13), (40, 64)]],
  ("llama4", 16, 4, 16, 32, 0, "smooth-alpha"),
  ("gemma3", 32, 0, 16, 32, 0, "smooth-alpha"),
]


def processed_key(case) -> str:
  processor, size, max_tiles, height, width, seed, style = case
  return f"{processor}-{size}-{max_tiles}-{style}{seed}-{height}x{width}"


def picture(height, width, seed=0, style="random"):
  """A uint8 test image: "random" noise (RGB), "smooth" (photo-like: resizers agree on most pixels), or
  "smooth-alpha" (RGBA, alpha rising from 0 on the left by 8 a column)."""
  if style == "random":
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
  y, x = np.mgrid[0:height, 0:width]
  phase = np.random.default_rng(seed).uniform(0, 6, 3)
  rgb = np.stack([127 + 120 * np.sin(x / 3 + p) * np.cos(y / 5 - p) for p in phase], -1).astype(np.uint8)
  if style == "smooth":
    return rgb
  alpha = np.tile((np.arange(width) * 8 % 256).astype(np.uint8), (height, 1))
  return np.concatenate([rgb, alpha[..., None]], -1)


def hf_processed(case):
  """The live processor's tiles [N, H, W, C] float32 for a PROCESSED-style case (needs transformers)."""
  import transformers  # noqa: PLC0415 (the torch tier)
  from PIL import Image  # noqa: PLC0415

  processor, size, max_tiles, height, width, seed, style = case
  image = Image.fromarray(picture(height, width, seed, style))
  if processor == "gemma3":
    made = transformers.Gemma3ImageProcessor(size={"height": size, "width": size}, do_pan_and_scan=False)
  else:
    made = transformers.Llama4ImageProcessor(size={"height": size, "width": size}, max_patches=max_tiles)
  return made(image, return_tensors="pt")["pixel_values"].float().numpy().transpose(0, 2, 3, 1)


def committed_processed():
  """{processed_key(case): tiles} as committed for every PROCESSED case."""
  from safetensors import numpy as safetensors_numpy  # noqa: PLC0415

  return safetensors_numpy.load_file(os.path.join(HF_REFERENCES, "processors", "pixels.safetensors"))


# Tiny random vision models (Gemma 3, Llama 4) and their transformers outputs, committed under
# hf_references/vision/<name>/ by make_vision.py; the tests convert the files and compare with the outputs.
VISION_REFERENCES = os.path.join(HF_REFERENCES, "vision")
G3V_TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
G3V_TEXT |= dict(vocab_size=64, head_dim=8, sliding_window=4, query_pre_attn_scalar=6)
G3V_VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, image_size=16)
G3V_VISION |= dict(patch_size=4, vision_use_head=False)
G3V_IMAGE, G3V_BOI, G3V_EOI = 60, 58, 59
VISION_NEW = 16  # greedy tokens


def build_vision_model(name):
  """The tiny random HF model `name` ("gemma3-vision" or "llama4-vision"), norms, biases (and Gemma 3's
  projector) random."""
  import torch  # noqa: PLC0415 (the torch tier)
  import transformers  # noqa: PLC0415

  torch.manual_seed(0)
  if name == "gemma3-vision":
    cfg = transformers.Gemma3Config(
      text_config=G3V_TEXT, vision_config=G3V_VISION, mm_tokens_per_image=4, image_token_index=G3V_IMAGE,
      boi_token_index=G3V_BOI, eoi_token_index=G3V_EOI,
    )  # fmt: skip
    model = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
  else:
    cfg = transformers.Llama4Config(text_config=L4V_TEXT, vision_config=L4V_VISION, image_token_index=L4V_IMAGE_TOKEN)
    model = transformers.Llama4ForConditionalGeneration(cfg).float().eval()
  with torch.no_grad():
    for n, p in model.named_parameters():
      if "norm" in n or n.endswith("bias") or "mm_input_projection" in n:
        centre = "layer_norm" in n if name == "gemma3-vision" else True
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if centre and n.endswith("weight") else 0.0))
  return model


def g3v_prompt(rng):
  """Two rows: text, an image (boi, 4 placeholders, eoi), text, a second image, text."""
  image = [G3V_BOI] + [G3V_IMAGE] * 4 + [G3V_EOI]
  return np.asarray([list(rng.integers(1, 50, 3)) + image + list(rng.integers(1, 50, 2)) + image + [7] for _ in "ab"])


def l4v_prompt(batch_images):
  """Text, 4 placeholders per tile, more text (one row)."""
  rng = np.random.default_rng(1)
  head, tail = rng.integers(0, 60, 3), rng.integers(0, 60, 4)
  return np.concatenate([head, np.full(4 * batch_images, L4V_IMAGE_TOKEN), tail])[None]


def vision_inputs(name):
  """The inputs the vision references are computed on: {"tokens", "pixels" (NCHW), "text"} and for Gemma 3 the
  Engine test's "engine_tokens", "engine_pixels" (two 16 x 16 images as data/images.py loads them)."""
  if name == "llama4-vision":
    pixels = np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)  # two tiles
    return {"tokens": l4v_prompt(2), "pixels": pixels, "text": np.random.default_rng(3).integers(0, 60, (1, 9))}
  rng = np.random.default_rng(0)
  tokens = g3v_prompt(rng)
  pixels = rng.uniform(-1, 1, (4, 3, 16, 16)).astype(np.float32)  # two images per row
  engine = np.random.default_rng(1).integers(0, 256, (2, 16, 16, 3)).astype(np.uint8)
  block = [G3V_BOI] + [G3V_IMAGE] * 4 + [G3V_EOI]
  out = {"tokens": tokens, "pixels": pixels, "text": np.asarray([[2, 9, 17, 33], [5, 1, 40, 12]])}
  out["engine_tokens"] = np.asarray([[3, 4, *block, 5, *block, 6]])
  out["engine_pixels"] = (engine.astype(np.float32) - 127.5) / 127.5  # as data/images.py loads them, NHWC
  return out


# llama4_images_test's word-level tokenizer holding Llama 4's image tokens, and its image file's prompt
L4V_VOCAB = {"[UNK]": 0, "describe": 5, "the": 6, "image": 7, "and": 8, "this": 9}
L4V_SPECIAL = {"<|image_start|>": 50, "<|image_end|>": 51, "<|tile_x_separator|>": 52, "<|tile_y_separator|>": 53}
L4V_SPECIAL |= {"<|image|>": 54, "<|patch|>": L4V_IMAGE_TOKEN}
L4V_FILE_PROMPT, L4V_FILE_NEW = "describe <|image|> the image", 8


def l4v_processor():
  """Llama4Processor (16 px tiles, at most 4) around the L4V word-level tokenizer (needs transformers)."""
  import transformers  # noqa: PLC0415 (the torch tier)
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  tok = Tokenizer(models.WordLevel(L4V_VOCAB | L4V_SPECIAL, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(list(L4V_SPECIAL))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
  images = transformers.Llama4ImageProcessor(size={"height": 16, "width": 16}, max_patches=4)
  return transformers.Llama4Processor(images, fast, patch_size=4, pixel_shuffle_ratio=0.5)


def l4v_file_outputs(model):
  """llama4_images_test's image file (a smooth 32 x 16 picture) through Llama4Processor and the model:
  {"file_ids", "file_pixels" (NHWC), "file_logits", "file_greedy"}."""
  import torch  # noqa: PLC0415 (the torch tier)
  from PIL import Image  # noqa: PLC0415

  image = Image.fromarray(picture(32, 16, 3, "smooth"))
  inputs = l4v_processor()(text=L4V_FILE_PROMPT, images=[image], return_tensors="pt")
  ids, pixels = inputs["input_ids"], inputs["pixel_values"].float()
  with torch.no_grad():
    logits = model(input_ids=ids, pixel_values=pixels).logits.numpy()
    new = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=L4V_FILE_NEW, do_sample=False)
  out = {"file_ids": ids.numpy().astype(np.int64), "file_pixels": pixels.numpy().transpose(0, 2, 3, 1)}
  out |= {"file_logits": logits, "file_greedy": new[:, ids.shape[1] :].numpy().astype(np.int64)}
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def vision_outputs(name, model):
  """transformers' float32 logits and greedy tokens on vision_inputs(name) (needs torch)."""
  import torch  # noqa: PLC0415 (the torch tier)

  x = vision_inputs(name)

  def run(tokens, pixels, greedy=False):
    kwargs = {"input_ids": torch.tensor(tokens)}
    if pixels is not None:
      kwargs["pixel_values"] = torch.tensor(pixels)
    if name == "gemma3-vision" and pixels is not None:
      kwargs["token_type_ids"] = torch.tensor((tokens == G3V_IMAGE).astype(np.int64))
    with torch.no_grad():
      if greedy:
        out = model.generate(**kwargs, max_new_tokens=VISION_NEW, do_sample=False)
        return out.numpy()[:, tokens.shape[1] :].astype(np.int64)
      return model(**kwargs).logits.numpy().astype(np.float32)

  first = x["tokens"][:1], (x["pixels"][:2] if name == "gemma3-vision" else x["pixels"])
  out = {"logits": run(x["tokens"], x["pixels"]), "greedy": run(*first, greedy=True)}
  out["text_logits"] = run(x["text"], None)
  if name == "llama4-vision":
    out |= l4v_file_outputs(model)
  if name == "gemma3-vision":
    out["engine_greedy"] = run(x["engine_tokens"], np.ascontiguousarray(x["engine_pixels"].transpose(0, 3, 1, 2)), True)
  return out


def vision_reference_outputs(name):
  from safetensors import numpy as safetensors_numpy  # noqa: PLC0415

  return safetensors_numpy.load_file(os.path.join(VISION_REFERENCES, name, "reference.safetensors"))


def vision_reference(name, tmp_path):
  """(The committed outputs of vision model `name`, a copy of its HF files under tmp_path/hf)."""

  source, path = os.path.join(VISION_REFERENCES, name), os.path.join(tmp_path, "hf")
  shutil.copytree(source, path, ignore=shutil.ignore_patterns("reference.*"))
  return vision_reference_outputs(name), path


# FP8 block-scaled checkpoints (DeepSeek V3 style) made in numpy (ml_dtypes), apart from convert/fp8.py's reader;
# transformers' logits on the dequantized deepseek3 reference: hf_references/fp8/deepseek3.safetensors (make_fp8.py).
FP8_BLOCK = (8, 16)  # not square, and partial blocks (q_lora_rank 12, moe_intermediate_size 16, hidden 32)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_tokens():
  return np.random.default_rng(0).integers(0, 64, (2, T))


def fp8_quantize(w):
  """w [out, in] float32 -> (float8_e4m3fn [out, in], scale_inv float32 [ceil(out/M), ceil(in/N)], the float32
  weights they stand for)."""
  import ml_dtypes  # noqa: PLC0415

  (m, n), (out, inner) = FP8_BLOCK, w.shape
  rows, cols = -(-out // m), -(-inner // n)
  padded = np.zeros((rows * m, cols * n), np.float32)
  padded[:out, :inner] = w
  scale_inv = np.maximum(np.abs(padded.reshape(rows, m, cols, n)).max(axis=(1, 3)), np.float32(1e-12))
  scale_inv = (scale_inv / np.float32(FP8_MAX)).astype(np.float32)
  full = np.repeat(np.repeat(scale_inv, m, 0), n, 1)[:out, :inner]
  q = (w / full).astype(ml_dtypes.float8_e4m3fn)
  return q, scale_inv, q.astype(np.float32) * full


def fp8_is_quantized(name, tensor):
  """As DeepSeek V3 ships: the linear weights of the layers in FP8; embeddings, norms, router, head not."""
  skip = ("norm", "embed_tokens", "lm_head", "mlp.gate.weight")
  return name.endswith(".weight") and tensor.ndim == 2 and not any(s in name for s in skip)


def save_safetensors_with_fp8(tensors, path):
  """A .safetensors file that may hold float8_e4m3fn arrays (numpy's safetensors writer has no float8 type)."""
  import struct  # noqa: PLC0415

  kinds = {"float32": "F32", "float8_e4m3fn": "F8_E4M3", "bfloat16": "BF16", "int64": "I64"}
  header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
  for name in sorted(tensors):
    data = np.ascontiguousarray(tensors[name]).tobytes()
    header[name] = {"dtype": kinds[tensors[name].dtype.name], "shape": list(tensors[name].shape)}
    header[name]["data_offsets"] = [offset, offset + len(data)]
    offset += len(data)
    blobs.append(data)
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_fp8_checkpoint(hf_path, float_path):
  """Rewrite hf_path's model.safetensors in FP8 with scale_inv tensors, and write the float weights they stand
  for (same config.json, no quantization_config) to float_path; returns how many weights are FP8."""
  from safetensors import numpy as safetensors_numpy  # noqa: PLC0415

  state = safetensors_numpy.load_file(os.path.join(hf_path, "model.safetensors"))
  stored, dequantized = {}, {}
  for name, w in state.items():
    if fp8_is_quantized(name, w):
      stored[name], stored[name + "_scale_inv"], dequantized[name] = fp8_quantize(w.astype(np.float32))
    else:
      stored[name] = dequantized[name] = w
  os.makedirs(float_path)
  safetensors_numpy.save_file(dequantized, os.path.join(float_path, "model.safetensors"), metadata={"format": "pt"})
  shutil.copy(os.path.join(hf_path, "config.json"), float_path)
  save_safetensors_with_fp8(stored, os.path.join(hf_path, "model.safetensors"))
  cfg = json.load(open(os.path.join(hf_path, "config.json")))
  cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
  cfg["quantization_config"]["weight_block_size"] = list(FP8_BLOCK)
  json.dump(cfg, open(os.path.join(hf_path, "config.json"), "w"))
  return len(stored) - len(state)


# Llama4Processor's ids for prompts with images of these sizes (1x1, 1x2, 2x1, 2x2 grids, two images), committed
# in hf_references/processors/ids.json by make_processors.py.
L4V_LAYOUTS = [[(16, 16)], [(16, 32)], [(32, 16)], [(32, 32)], [(32, 32), (16, 16)]]


def l4v_layout_text(sizes):
  return "describe " + " and ".join(["<|image|>"] * len(sizes)) + " this"


def l4v_layout_key(sizes):
  return "+".join(f"{h}x{w}" for h, w in sizes)


def hf_layout_ids(sizes):
  """Llama4Processor's ids for l4v_layout_text(sizes) with smooth pictures of those sizes (needs transformers)."""
  from PIL import Image  # noqa: PLC0415

  images = [Image.fromarray(picture(h, w, 0, "smooth")) for h, w in sizes]
  return l4v_processor()(text=l4v_layout_text(sizes), images=images, return_tensors="pt")["input_ids"][0].tolist()


def committed_ids():
  return json.load(open(os.path.join(HF_REFERENCES, "processors", "ids.json")))


# Gemma3Processor's ids (its "\n\n" around each image block) over the tiny vision model's tokenizer trained on
# runs of newlines, committed in hf_references/processors/ids.json: (text, images, add_special_tokens).
G3_TOKENIZER_TEXTS = ["What colour is this?\n\nIt is red.\n\n\nA cat\n\n\n\n", "user\nassistant\n\n"] * 16
G3_PROMPTS = [
  ("<s>user\n<start_of_image>What colour is this?", 1, False),
  ("What colour is this?\n<start_of_image>\n", 1, False),
  ("<start_of_image><start_of_image>A cat\n\n<start_of_image>", 3, False),
  ("user\n\n<start_of_image>It is red.\n<start_of_image>What colour is this?", 2, False),
  ("<s><start_of_image><start_of_image>What colour is this?", 2, True),
]
G3_SFT_MESSAGES = [
  {"role": "user", "content": "<start_of_image>What colour is this?\n<start_of_image>"},
  {"role": "assistant", "content": "It is red."},
]


def g3_prompt_key(text, n, special):
  return f"{n}|{int(special)}|{text}"


def gemma3_tokenizer(directory):
  """The tiny vision model's tokenizer (tokenizer.json, tokenizer_config.json) in directory."""
  end_to_end_script("make_tiny_vision_model").write_tokenizer(directory, G3_TOKENIZER_TEXTS)


def gemma3_processor(directory):
  """Gemma3Processor (16 px, 4 soft tokens an image) over gemma3_tokenizer(directory) (needs transformers)."""
  import transformers  # noqa: PLC0415 (the torch tier)

  special = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_file=os.path.join(directory, "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>",
    pad_token="<pad>", extra_special_tokens=special,
  )  # fmt: skip
  image_processor = transformers.Gemma3ImageProcessor(size={"height": 16, "width": 16}, do_pan_and_scan=False)
  chatml = end_to_end_script("make_tiny_vision_model").CHATML
  return transformers.Gemma3Processor(image_processor, fast, image_seq_length=4, chat_template=chatml)


def g3_sft_text(directory):
  """G3_SFT_MESSAGES rendered by the tokenizer's chat template (data/chat.py)."""
  from MaxText.data import chat  # noqa: PLC0415

  return chat.load_template(tokenizers.HuggingFaceTokenizer(directory)).render(G3_SFT_MESSAGES)


def hf_gemma3_prompt_ids(processor, text, n, special):
  images = [picture(5, 5, i) for i in range(n)]  # the ids depend on the number of images only
  return [int(i) for i in processor(text=[text], images=[images], add_special_tokens=special)["input_ids"][0]]


def layout_loss_and_grads(tiny, *overrides, devices: int = 1):
  """The next-token loss of a fresh model (config `tiny` plus `overrides`, params seed 0) on a fixed batch of 8 x 16
  tokens, and its gradients, on the first `devices` CPU devices under the mesh the ici_* overrides give: equal
  across layouts up to float32 summation order."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (8, 17)), jnp.int32)
  positions, segments = jnp.broadcast_to(jnp.arange(16), (8, 16)), jnp.ones((8, 16), jnp.int32)
  c = config.load([*tiny, "max_target_length=16", "ici_fsdp_parallelism=1", "ici_data_parallelism=1", *overrides], {})
  mesh = sharding.create_mesh(c, jax.devices()[:devices])
  graphdef, params = nnx.split(built(c, planner.build(c, mesh)), nnx.Param)

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens[:, :-1], positions, segments).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

  with sharding.activate(c, mesh):
    specs = sharding.logical_to_mesh(nnx.get_partition_spec(params), mesh, sharding.axis_rules(c))
    placed = jax.device_put(params, specs)
    return jax.jit(jax.value_and_grad(loss))(placed)
