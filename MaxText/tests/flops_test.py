"""Model FLOPs per token, counted on the built model (flops.py), against counts written out by hand: the
tiny model of each family, the published sizes of the presets, and XLA's own count; and the MFU arithmetic."""

import os

import pytest
from flax import nnx

from MaxText import config as config_lib
from MaxText import flops as flops_lib
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.moe import MoeBlock
from MaxText.tests.conftest import sized_config


@pytest.mark.quick
def test_flops_per_token_by_hand(tmp_path):
  cfg = sized_config(tmp_path)  # D=64, N=4, K=2, H=16, F=128, L=2, V=256, T=32, 2 MLP inputs
  # attention projections per layer: q 64*4*16 + k 64*2*16 + v 64*2*16 + o 4*16*64 = 4096+2048+2048+4096 = 12288
  # MLP per layer: (2 inputs + 1 output) * 64*128 = 24576; per layer 36864; 2 layers 73728; x6 = 442368
  # unembedding: 6 * 64 * 256 = 98304
  # causal attention: 6 * L * N * H * T = 6 * 2 * 4 * 16 * 32 = 24576
  flops = flops_lib.training_flops_per_token(cfg)
  assert flops.matmul == 442368
  assert flops.embedding == 98304
  assert flops.attention == 24576
  assert flops.total == 442368 + 98304 + 24576 == 565248


def test_flops_per_token_single_activation_mlp(tmp_path):
  cfg = sized_config(tmp_path, "mlp_activations=[gelu]")
  # MLP drops one input projection: 2 layers * 6 * 64*128 = 98304 fewer FLOPs
  assert flops_lib.training_flops_per_token(cfg).total == 565248 - 98304


def test_lora_flops_count_frozen_weights_at_4_and_adapters_at_6(tmp_path):
  """Under LoRA the base gets activation gradients but no weight gradients: 4 FLOPs per frozen weight, 6 per
  adapter weight, attention as before (sized_config: D=64, N=4, K=2, H=16, F=128, L=2, V=256, T=32)."""
  cfg = sized_config(tmp_path, "lora_rank=4")
  # rank-4 adapters A [in, 4], B [4, out] on q, k, v, o, wi/0, wi/1, wo, per layer:
  # 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)) = 4 * 1024 = 4096
  model = flops_lib.abstract_model(cfg)
  assert flops_lib.forward_count(model, 32).adapters == 2 * 4096
  flops = flops_lib.training_flops_per_token(cfg, model)
  assert flops.matmul == 4 * 73728 + 6 * 8192  # frozen 73,728 layer weights (test_flops_per_token_by_hand)
  assert flops.embedding == 4 * 64 * 256
  assert flops.attention == 24576
  assert flops_lib.training_flops_per_token(cfg) == flops  # built here from the config: the same model


def test_quantized_model_counts_as_the_plain_one(tmp_path):
  """Quantization wraps the model's matmuls (Qwix changes its class, not its parameters): same FLOPs."""
  plain = flops_lib.training_flops_per_token(sized_config(tmp_path))
  assert flops_lib.training_flops_per_token(sized_config(tmp_path, "quantization=int8")) == plain


def test_attended_keys_global_sliding_and_chunked():
  assert flops_lib.attended_keys(32) == 16  # causal: half of 32
  assert flops_lib.attended_keys(32, sliding_window=8) == 8 - 64 / 64  # T*S - S^2/2 = 224 keys, / 32
  assert flops_lib.attended_keys(32, sliding_window=64) == 16  # a window past the sequence is global
  assert flops_lib.attended_keys(32, chunk_window=8) == 4  # four causal blocks of 8: 8^2/2 = 32 keys each, / 8
  assert flops_lib.attended_keys(36, chunk_window=8) == (4 * 32 + 4**2 / 2) / 36  # and a last block of 4
  assert flops_lib.attended_keys(32, chunk_window=64) == 16
  assert flops_lib.attended_keys(32, sliding_window=4, chunk_window=8) == (8 * 4 - 4**2 / 2) / 8  # a band per block


# One tiny model per family, counted by hand from sized_config's D=64, N=4, K=2, H=16, F=128, V=256, T=32:
#   attention projections per layer: q 64*4*16 + k 64*2*16 + v 64*2*16 + o 4*16*64 = 12288
#   SwiGLU MLP per layer: 3 * 64*128 = 24576; the logits head 64*256 = 16384 (x6 = 98304)
#   forward QK^T + AV per layer and token: 2 * keys * N * (H_qk + H_v) = 2 * keys * 4 * 32 = 256 * keys, where keys
#   is 16 (global, T/2), 7 (a window of 8: 8 - 8^2/64) or 4 (blocks of 8: 8^2/2 keys for 8 queries)
# matmul = 6 * layer weights, attention = 3 * forward, embedding = 6 * 16384 (98304) unless said.
MOE = ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32"]
MLA = ["q_lora_rank=16", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8"]
LLAMA4 = [
  "decoder_block=llama4", "base_num_decoder_layers=8", "nope_layer_interval=4", "interleave_moe_layer_step=2",
  "chunk_attn_window_size=8", "num_experts=4", "num_experts_per_tok=1", "shared_experts=1", "base_moe_mlp_dim=32",
  "routed_score_func=sigmoid", "routed_weight_on_input=true", "temperature_tuning=true",
]  # fmt: skip
# fmt: off
FAMILIES = {
  # 2 layers of 12288 + 24576 = 36864; two global layers
  "llama2": (["decoder_block=llama2"], 6 * 2 * 36864, 3 * 2 * 256 * 16, 98304),
  # every layer a window of 8
  "mistral": (["decoder_block=mistral", "sliding_window_size=8"], 6 * 2 * 36864, 3 * 2 * 256 * 7, 98304),
  # MoE layers: 2 routed SwiGLU experts of width 32 (2 * 3 * 64*32 = 12288) and the router 64*4 = 256
  "mixtral": (["decoder_block=mixtral", *MOE], 6 * 2 * (12288 + 12288 + 256), 3 * 2 * 256 * 16, 98304),
  # qwen3 MoE with q/k norms (no matmuls): 8 experts, top 2: router 64*8 = 512
  "qwen3": (
    ["decoder_block=qwen3", "use_qk_norm=true", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=32"],
    6 * 2 * (12288 + 12288 + 512), 3 * 2 * 256 * 16, 98304,
  ),
  # GeGLU and tied logits: the head is the embedding table, still 64*256
  "gemma": (
    ["decoder_block=gemma", "logits_via_embedding=true", "mlp_activations=[gelu,linear]"],
    6 * 2 * 36864, 3 * 2 * 256 * 16, 98304,
  ),
  # 5 layers: local, global, local, global, local (two scanned pairs and a remainder layer)
  "gemma2": (
    ["decoder_block=gemma2", "base_num_decoder_layers=5", "sliding_window_size=8"],
    6 * 5 * 36864, 3 * 256 * (3 * 7 + 2 * 16), 98304,
  ),
  # 8 layers: 5 local, 1 global, then a remainder of 2 local: 7 local, 1 global
  "gemma3": (
    ["decoder_block=gemma3", "base_num_decoder_layers=8", "sliding_window_size=8"],
    6 * 8 * 36864, 3 * 256 * (7 * 7 + 16), 98304,
  ),
  # plain GELU MLP (2 * 64*128 = 16384); biases and the learned positions are not matmuls
  "gpt3": (
    ["decoder_block=gpt3", "trainable_position_size=32", "mlp_activations=[gelu]"],
    6 * 2 * (12288 + 16384), 3 * 2 * 256 * 16, 98304,
  ),
  # 3 MLA layers: wq_a 64*16 + wq_b 16*4*16 + wkv_a 64*(16+8) + wkv_b 16*4*(8+8) + out 4*8*64
  #   = 1024 + 1024 + 1536 + 1024 + 2048 = 6656; forward attention 2 * 16 keys * 4 * (16 + 8) = 3072
  # layer 0 a dense SwiGLU MLP (24576); layers 1-2 MoE: routed 12288, one shared expert 3 * 64*32 = 6144, router 256
  "deepseek": (
    ["decoder_block=deepseek", "base_num_decoder_layers=3", "first_num_dense_layers=1", "shared_experts=1", *MOE, *MLA],
    6 * (3 * 6656 + 24576 + 2 * (12288 + 6144 + 256)), 3 * 3 * 3072, 98304,
  ),
  # ... and one MTP module: one more MoE layer, its eh_proj 2*64*64 = 8192, one more logits head
  "deepseek-mtp": (
    ["decoder_block=deepseek", "base_num_decoder_layers=3", "first_num_dense_layers=1", "shared_experts=1", *MOE, *MLA,
     "mtp_num_layers=1"],
    6 * (4 * 6656 + 24576 + 3 * (12288 + 6144 + 256) + 8192), 3 * 4 * 3072, 2 * 98304,
  ),
  # 8 layers: NoPE (global) layers 3 and 7, the other 6 chunked (blocks of 8); MoE layers 1, 3, 5, 7 (one routed
  # expert 3 * 64*32 = 6144, one shared 6144, router 256), dense SwiGLU layers 0, 2, 4, 6
  "llama4": (LLAMA4, 6 * (8 * 12288 + 4 * 24576 + 4 * (6144 + 6144 + 256)), 3 * 256 * (6 * 4 + 2 * 16), 98304),
  # 6 layers sliding (window 8), full, ...; full layers H=32 with one kv head and K = V (no v); the last 2 layers
  # share K/V (no k or v projections) with double-wide MLPs (3 * 64*256 = 49152); per-layer embeddings of P=8: in
  # every layer gate 64*8 + projection 8*64 = 1024, once the model projection 64*(6*8) = 3072 (its table a lookup).
  # sliding 12288 + 24576 + 1024 = 37888; full q 64*4*32 + k 64*32 + o 4*32*64 = 18432, + 24576 + 1024 = 44032;
  # shared sliding 4096 + 4096 + 49152 + 1024 = 58368; shared full 8192 + 8192 + 49152 + 1024 = 66560.
  # Attention as computed: 3 sliding layers 256 * 7, 3 full 2 * 16 * 4 * (32 + 32) = 512 * 16 (shared ones too).
  "gemma4": (
    ["decoder_block=gemma4", "base_num_decoder_layers=6", "full_attention_interval=2", "sliding_window_size=8",
     "global_head_dim=32", "global_num_kv_heads=1", "attention_k_eq_v=true", "num_kv_shared_layers=2",
     "use_double_wide_mlp=true", "hidden_size_per_layer_input=8", "vocab_size_per_layer_input=32",
     "mlp_activations=[gelu,linear]", "logits_via_embedding=true"],
    6 * (2 * 37888 + 2 * 44032 + 58368 + 66560 + 3072), 3 * (3 * 256 * 7 + 3 * 512 * 16), 98304,
  ),
}
# fmt: on


@pytest.mark.parametrize("scan", ["true", "false"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flops_of_each_family_by_hand(tmp_path, family, scan):
  overrides, matmul, attention, embedding = FAMILIES[family]
  flops = flops_lib.training_flops_per_token(sized_config(tmp_path, *overrides, f"scan_layers={scan}"))
  assert (flops.matmul, flops.attention, flops.embedding) == (matmul, attention, embedding)
  assert flops.total == matmul + attention + embedding


@pytest.mark.parametrize("family", FAMILIES)
def test_every_matrix_is_a_projection_expert_or_lookup_table(tmp_path, family):
  """The count reads DenseGeneral kernels and MoeBlock experts: a family that multiplied by another matrix
  would go uncounted, so there is none (unstacked layers: a matrix is a parameter of 2 or more dims)."""
  model = flops_lib.abstract_model(sized_config(tmp_path, *FAMILIES[family][0], "scan_layers=false"))
  counted = {id(model.token_embedder.embedding)}  # the input lookup (and the head when tied)
  if model.position_embedder is not None:
    counted.add(id(model.position_embedder.embedding))
  for _, module in nnx.iter_modules(model):
    if isinstance(module, Embed):  # a lookup table (gemma4's per-layer embeddings too)
      counted.add(id(module.embedding))
    elif isinstance(module, DenseGeneral):
      counted |= {id(module.kernel), id(module.bias)}  # a bias is added, not multiplied (gpt3's q/k/v: [N, H])
    elif isinstance(module, MoeBlock):
      counted |= {id(getattr(module, name)) for name in flops_lib.EXPERT_WEIGHTS}
  matrices = [p for _, p in nnx.iter_graph(model) if isinstance(p, nnx.Param) and p.get_value().ndim >= 2]
  assert matrices and all(id(p) in counted for p in matrices)


def test_flops_llama4_maverick_chunks_and_interleaves(tmp_path):
  """Llama 4 Maverick: 48 layers, dense (F=16384) and MoE (128 experts top-1, width 8192, 1 shared) alternating,
  every 4th layer NoPE (global), the others attention in chunks of 8192."""
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "llama4-17b-128e", 32768))
  # D=5120 N=40 K=8 H=128 V=202048
  attention_proj = 5120 * 128 * (40 + 8 + 8 + 40)  # 62,914,560
  dense = 3 * 5120 * 16384  # 251,658,240
  moe = 3 * 5120 * 8192 + 3 * 5120 * 8192 + 5120 * 128  # routed + shared + router: 252,313,600
  active = 48 * attention_proj + 24 * dense + 24 * moe
  assert active == 15_115_223_040
  assert 17.1e9 < active + 2 * 5120 * 202048 < 17.3e9  # Meta's published 17B active (17.2B in HF's count)
  assert flops.matmul == 6 * active
  assert flops.embedding == 6 * 5120 * 202048
  # 12 NoPE layers see 32768 / 2 keys per query, 36 chunked layers 8192 / 2 (four blocks of 8192)
  assert flops.attention == 3 * 2 * 40 * 256 * (12 * 16384 + 36 * 4096)


def preset(tmp_path, name, length, *overrides):
  return config_lib.load(
    [
      os.path.join(config_lib.CONFIG_DIR, "base.yml"),
      "run_name=t",
      f"base_output_directory={tmp_path}",
      f"model_name={name}",
      f"max_target_length={length}",
      *overrides,
    ]
  )


# Per-family counts written out from each preset's numbers (models/<family>/presets/*.yml), independently of
# flops.py: matmul = 6 x active weights per token, embedding = 6 D V, attention = 3 x forward, where
# forward QK^T + AV per layer and token = 2 FLOPs x S_eff keys x N heads x (H_qk + H_v), S_eff = T/2
# for global causal layers and S - S^2/(2T) for a window S < T.


def test_flops_llama2_7b(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "llama2-7b", 4096))
  # D=4096 N=K=32 H=128 F=11008 L=32 V=32000, SwiGLU (3 MLP matmuls)
  per_layer = 4096 * 128 * (32 + 32 + 32 + 32) + 3 * 4096 * 11008  # 67,108,864 + 135,266,304
  assert per_layer * 32 == 6_476_005_376  # the 6.48B non-embedding parameters
  assert flops.matmul == 6 * 6_476_005_376
  assert flops.embedding == 6 * 4096 * 32000
  assert flops.attention == 3 * 32 * 2 * (4096 / 2) * 32 * (128 + 128) == 6 * 32 * 32 * 128 * 4096


def test_flops_mixtral_8x7b_counts_two_routed_experts(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "mixtral-8x7b", 4096))
  # D=4096 N=32 K=8 H=128 F=14336 L=32 V=32000, 8 experts top-2
  attention_proj = 4096 * 128 * (32 + 8 + 8 + 32)  # 41,943,040
  experts = 2 * 3 * 4096 * 14336 + 4096 * 8  # two SwiGLU experts + the router: 352,354,304
  active = 32 * (attention_proj + experts) + 2 * 4096 * 32000  # + input and output embeddings
  assert 12.8e9 < active < 13.0e9  # Mixtral's published 12.9B active parameters
  assert flops.matmul == 6 * 32 * (41_943_040 + 352_354_304)
  assert flops.attention == 6 * 32 * 32 * 128 * 4096
  # the old count (one dense MLP of width mlp_dim) was ~1.8x lower on the layers
  assert flops.matmul / (6 * 32 * (41_943_040 + 3 * 4096 * 14336)) == pytest.approx(1.81, abs=0.01)


def test_flops_expert_width_scales_with_global_parameter_scale(tmp_path):
  # A MoE model grown 4x: mlp widths double (base 64 -> 128, expert base 32 -> 64), as MoeBlock builds them.
  moe = ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "base_mlp_dim=64", "base_emb_dim=16"]
  c = sized_config(tmp_path, *moe, "global_parameter_scale=4", "base_num_query_heads=2", "base_num_kv_heads=2")
  assert c.moe_mlp_dim == 64 and c.emb_dim == 32
  layer_moe = 2 * 3 * 32 * 64 + 32 * 4  # two routed experts of width 64, and the router
  attention_proj = 32 * c.head_dim * (2 * c.num_query_heads + 2 * c.num_kv_heads)
  assert flops_lib.training_flops_per_token(c).matmul == 6 * c.num_decoder_layers * (attention_proj + layer_moe)


def test_flops_deepseek3_671b(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "deepseek3-671b", 4096))
  # D=7168 N=128 L=61 (3 dense, F=18432) V=129280; MLA: q_lora 1536, kv_lora 512, nope 128, rope 64, v 128;
  # MoE: 256 experts top-8, width 2048, 1 shared
  mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * 7168
  assert mla == 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512 == 187_105_280
  dense = 3 * 7168 * 18432  # 396,361,728
  moe = 8 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 7168 * 256  # routed + shared + router: 398,196,736
  active = 61 * mla + 3 * dense + 58 * moe
  assert active == 35_697_917_952
  assert 36.5e9 < active + 2 * 7168 * 129280 < 38e9  # DeepSeek's published "37B activated"
  assert flops.matmul == 6 * active
  assert flops.embedding == 6 * 7168 * 129280
  # forward per layer and token: 2 x 2048 keys x 128 heads x (192 + 128)
  assert flops.attention == 61 * 3 * 2 * 2048 * 128 * (192 + 128)


DEEPSEEK = ["decoder_block=deepseek", "base_num_decoder_layers=3", "first_num_dense_layers=1", "shared_experts=1"]
INDEXER = ["index_n_heads=2", "index_head_dim=16"]


@pytest.mark.parametrize("scan", ["true", "false"])
def test_flops_deepseek32_indexer_forward_only_and_dense_masked_attention(tmp_path, scan):
  """FAMILIES["deepseek"] with a lightning indexer in each of its 3 layers (T=32, 2 index heads of 16 dims)."""
  cfg = sized_config(tmp_path, *DEEPSEEK, *MOE, *MLA, *INDEXER, "index_topk=8", f"scan_layers={scan}")
  flops = flops_lib.training_flops_per_token(cfg)
  # wq_b 16*2*16 + wk 64*16 + weights_proj 64*2 = 1664 weights; q.k over all 32 keys: 2*32*2*16, weighting 2*32*2
  per_layer = 2 * 1664 + 2 * 32 * 2 * 16 + 2 * 32 * 2
  assert flops.indexer == 3 * per_layer == 16512  # x1: no gradient reaches the indexer
  assert flops.matmul == FAMILIES["deepseek"][1]  # its projections are not in matmul (x6)
  # the top-k mask is dense: every one of the 32 keys per query is computed, twice the causal count of 16
  assert flops.attention == 2 * FAMILIES["deepseek"][2] == 3 * 3 * 2 * 32 * 4 * (16 + 8)
  assert flops.total == flops.matmul + flops.attention + flops.embedding + 16512
  # no more keys than index_topk: the selection is skipped (no indexer work), the mask path stays dense
  short = flops_lib.training_flops_per_token(sized_config(tmp_path, *DEEPSEEK, *MOE, *MLA, *INDEXER, "index_topk=32"))
  assert (short.indexer, short.attention) == (0, flops.attention)


def test_flops_deepseek32_671b(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "deepseek32-671b", 4096))
  # deepseek3-671b's counts, plus per layer an indexer: 64 heads of 128 dims, top 2048 of the 4096 keys
  indexer = 1536 * 64 * 128 + 7168 * 128 + 7168 * 64  # wq_b, wk, weights_proj
  assert 61 * indexer == 851_509_248  # DeepSeek's "0.85B" of indexers beside the 671B
  assert flops.matmul == 6 * 35_697_917_952  # test_flops_deepseek3_671b's active weights, no more
  assert flops.indexer == 61 * (2 * indexer + 2 * 4096 * 64 * (128 + 1))
  # dense-masked attention: all 4096 keys per query, where the top-k ideal is 2048 - 2048^2 / 8192 = 1536
  assert flops.attention == 61 * 3 * 2 * 4096 * 128 * (192 + 128)
  assert flops_lib.attended_keys(4096, 2048) == 1536


def test_flops_kimi_k2_1t(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "kimi-k2-1t", 4096))
  # deepseek3-671b's layers with N=64, V=163840, 1 dense layer, 384 experts top-8 in one group
  mla = 7168 * 1536 + 1536 * 64 * 192 + 7168 * (512 + 64) + 512 * 64 * (128 + 128) + 64 * 128 * 7168
  assert mla == 101_122_048
  moe = 8 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 7168 * 384  # routed + shared + router: 399,114,240
  active = 61 * mla + 3 * 7168 * 18432 + 60 * moe
  assert active == 30_511_661_056
  assert 32e9 < active + 2 * 7168 * 163840 < 33e9  # Moonshot's published "32B activated"
  assert flops.matmul == 6 * active
  assert flops.embedding == 6 * 7168 * 163840
  assert flops.attention == 61 * 3 * 2 * 2048 * 64 * (192 + 128)


def test_flops_deepseek2_16b_plain_query(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "deepseek2-16b", 2048))
  # D=2048 N=16 L=27 (1 dense, F=10944) V=102400; q_lora 0; 64 experts top-6, width 1408, 2 shared
  mla = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048  # 13,762,560
  moe = 6 * 3 * 2048 * 1408 + 3 * 2048 * 1408 * 2 + 2048 * 64  # 69,337,088
  active = 27 * mla + 3 * 2048 * 10944 + 26 * moe
  assert 2.3e9 < active + 2048 * 102400 < 2.5e9  # published: 2.4B activated
  assert flops.matmul == 6 * active
  assert flops.attention == 27 * 3 * 2 * 1024 * 16 * 320


def test_flops_gemma2_2b_alternates_local_and_global(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "gemma2-2b", 8192))
  # D=2304 N=8 K=4 H=256 F=9216 L=26 V=256000 (tied); 13 local layers (window 4096) and 13 global
  assert flops.matmul == 6 * 26 * (2304 * 256 * 24 + 3 * 2304 * 9216)
  assert flops.embedding == 6 * 2304 * 256000
  local_keys = 4096 - 4096**2 / (2 * 8192)  # 3072: the first 4096 queries see fewer keys
  global_keys = 8192 / 2
  assert flops.attention == 3 * 2 * 8 * 512 * (13 * local_keys + 13 * global_keys) == 2_290_089_984
  # a window as long as the sequence is plain causal attention
  short = flops_lib.training_flops_per_token(preset(tmp_path, "gemma2-2b", 4096))
  assert short.attention == 6 * 26 * 8 * 256 * 4096


def test_flops_gemma3_4b_five_local_one_global(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "gemma3-4b", 4096))
  # L=34: layers 5, 11, 17, 23, 29 global, the other 29 local (window 1024); D=2560 N=8 K=4 H=256 F=10240
  assert flops.matmul == 6 * 34 * (2560 * 256 * 24 + 3 * 2560 * 10240)
  local_keys = 1024 - 1024**2 / (2 * 4096)  # 896
  assert flops.attention == 3 * 2 * 8 * 512 * (29 * local_keys + 5 * 2048) == 890_241_024


def test_flops_mistral_7b_sliding_window(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "mistral-7b", 8192))
  # every layer local, window 4096; D=4096 N=32 K=8 H=128 F=14336 L=32
  assert flops.matmul == 6 * 32 * (4096 * 128 * 80 + 3 * 4096 * 14336)
  assert flops.attention == 32 * 3 * 2 * 3072 * 32 * 256


def test_flops_gpt3_175b(tmp_path):
  flops = flops_lib.training_flops_per_token(preset(tmp_path, "gpt3-175b", 2048))
  # D=12288 N=K=96 H=128 F=49152 L=96 V=50304, plain GELU MLP (2 matmuls)
  per_layer = 12288 * 128 * 4 * 96 + 2 * 12288 * 49152
  assert 173e9 < 96 * per_layer < 175e9  # GPT-3's 175B, less the embeddings
  assert flops.matmul == 6 * 96 * per_layer
  assert flops.embedding == 6 * 12288 * 50304
  assert flops.attention == 6 * 96 * 96 * 128 * 2048


def xla_training_flops(cfg, batch_size):
  """XLA's FLOP count (cost analysis) of one forward + backward of the loss on a [batch_size, T] batch."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from MaxText import models, planner
  from MaxText.objectives import lm

  plan = planner.build(cfg)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: models.build(cfg, nnx.Rngs(params=0), plan)), nnx.Param)
  tokens = jax.ShapeDtypeStruct((batch_size, cfg.max_target_length), jnp.int32)
  batch = {k: tokens for k in ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")}
  grad = jax.jit(jax.grad(lambda p, b: lm.loss_sums(graphdef, cfg, p, b, None)[0]))
  return grad.lower(params, batch).compile().cost_analysis()["flops"]


TINY_DENSE = [
  "base_emb_dim=256",
  "base_num_query_heads=4",
  "base_num_kv_heads=4",
  "head_dim=64",
  "base_mlp_dim=1024",
  "base_num_decoder_layers=2",
  "vocab_size=1024",
  "max_target_length=256",
  "dtype=float32",
  "weight_dtype=float32",
  "scan_layers=false",  # XLA's cost analysis counts a while loop's body once, not per iteration
  "remat_policy=none",  # recomputation would add forward FLOPs that are not model FLOPs
  "attention=dot_product",
]

MLA_XLA = ["decoder_block=deepseek", "q_lora_rank=128", "kv_lora_rank=128", "qk_nope_head_dim=48", "v_head_dim=64"]


@pytest.mark.parametrize(
  "overrides",
  [
    [],
    ["base_num_kv_heads=2", "mlp_activations=[gelu]"],
    # MoE: capacity_factor=1 runs exactly tokens x k assignments as einsums XLA can count (ragged_dot it may not)
    ["num_experts=4", "num_experts_per_tok=2", "capacity_factor=1.0", "base_moe_mlp_dim=512"],
    MLA_XLA,
    # V3.2: the indexer's forward over all keys (index_topk < T) and the dense-masked attention
    [*MLA_XLA, "index_n_heads=4", "index_head_dim=64", "index_topk=64", "attention_query_chunk=0"],
  ],
  ids=["dense", "gqa-gelu", "moe", "mla", "mla-indexer"],
)
def test_flops_match_xla_cost_analysis(tmp_path, overrides):
  cfg = sized_config(tmp_path, *TINY_DENSE, *overrides)
  batch_size = 2
  ours = flops_lib.training_flops_per_token(cfg).total * batch_size * cfg.max_target_length
  xla = xla_training_flops(cfg, batch_size)
  # XLA counts everything we count plus elementwise ops, softmax, norms and the masked upper half of the
  # attention scores (a few percent here: 0.92-0.94 with jax 0.10); a wrong structure is off by far more
  assert 0.88 < ours / xla <= 1.0, (ours, xla)


@pytest.mark.quick
def test_mfu():
  # 1e12 FLOPs per step over 2 devices in 0.5 s: 1e12 FLOP/s per device, a quarter of a 4e12 peak
  assert flops_lib.mfu(1e12, 0.5, 2, 4e12) == pytest.approx(0.25)
