"""FLOP count, MFU arithmetic, the metric writers and the plot script."""

import glob
import json
import math
import os
import time

import pytest

from MaxText import config as config_lib
from MaxText import metrics, plot_metrics


def make_config(tmp_path, *overrides):
  return config_lib.load(
    [
      os.path.join(config_lib.CONFIG_DIR, "base.yml"),
      "run_name=t",
      f"base_output_directory={tmp_path}",
      "base_emb_dim=64",
      "base_num_query_heads=4",
      "base_num_kv_heads=2",
      "head_dim=16",
      "base_mlp_dim=128",
      "base_num_decoder_layers=2",
      "vocab_size=256",
      "max_target_length=32",
      *overrides,
    ]
  )


def make_logger(cfg, **kwargs):
  args = dict(
    num_devices=2, tokens_per_step=1000, flops_per_step=1e12, peak_flops_per_device=4e12, start_step=0, is_writer=True
  )
  return metrics.MetricLogger(cfg, **{**args, **kwargs})


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_flops_per_token_by_hand(tmp_path):
  cfg = make_config(tmp_path)  # D=64, N=4, K=2, H=16, F=128, L=2, V=256, T=32, 2 MLP inputs
  # attention projections per layer: q 64*4*16 + k 64*2*16 + v 64*2*16 + o 4*16*64 = 4096+2048+2048+4096 = 12288
  # MLP per layer: (2 inputs + 1 output) * 64*128 = 24576; per layer 36864; 2 layers 73728; x6 = 442368
  # unembedding: 6 * 64 * 256 = 98304
  # causal attention: 6 * L * N * H * T = 6 * 2 * 4 * 16 * 32 = 24576
  flops = metrics.training_flops_per_token(cfg)
  assert flops.matmul == 442368
  assert flops.embedding == 98304
  assert flops.attention == 24576
  assert flops.total == 442368 + 98304 + 24576 == 565248


def test_flops_per_token_single_activation_mlp(tmp_path):
  cfg = make_config(tmp_path, "mlp_activations=[gelu]")
  # MLP drops one input projection: 2 layers * 6 * 64*128 = 98304 fewer FLOPs
  assert metrics.training_flops_per_token(cfg).total == 565248 - 98304


def test_lora_flops_count_frozen_weights_at_4_and_adapters_at_6(tmp_path):
  """Under LoRA the base gets activation gradients but no weight gradients: 4 FLOPs per frozen weight, 6 per
  adapter weight, attention as before (make_config: D=64, N=4, K=2, H=16, F=128, L=2, V=256, T=32)."""
  cfg = make_config(tmp_path, "lora_rank=4")
  # rank-4 adapters A [in, 4], B [4, out] on q, k, v, o, wi/0, wi/1, wo, per layer:
  # 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64)) = 4 * 1024 = 4096
  assert metrics.adapter_params(cfg) == 2 * 4096
  flops = metrics.training_flops_per_token(cfg)
  assert flops.matmul == 4 * 73728 + 6 * 8192  # frozen 73,728 layer weights (test_flops_per_token_by_hand)
  assert flops.embedding == 4 * 64 * 256
  assert flops.attention == 24576
  assert metrics.training_flops_per_token(cfg, 8192) == flops  # the count a run already has (StateSpec)


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


# Per-family counts written out from each preset's numbers (configs/models/*.yml), independently of
# metrics.py: matmul = 6 x active weights per token, embedding = 6 D V, attention = 3 x forward, where
# forward QK^T + AV per layer and token = 2 FLOPs x S_eff keys x N heads x (H_qk + H_v), S_eff = T/2
# for global causal layers and S - S^2/(2T) for a window S < T.


def test_flops_llama2_7b(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "llama2-7b", 4096))
  # D=4096 N=K=32 H=128 F=11008 L=32 V=32000, SwiGLU (3 MLP matmuls)
  per_layer = 4096 * 128 * (32 + 32 + 32 + 32) + 3 * 4096 * 11008  # 67,108,864 + 135,266,304
  assert per_layer * 32 == 6_476_005_376  # the 6.48B non-embedding parameters
  assert flops.matmul == 6 * 6_476_005_376
  assert flops.embedding == 6 * 4096 * 32000
  assert flops.attention == 3 * 32 * 2 * (4096 / 2) * 32 * (128 + 128) == 6 * 32 * 32 * 128 * 4096


def test_flops_mixtral_8x7b_counts_two_routed_experts(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "mixtral-8x7b", 4096))
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
  c = make_config(tmp_path, *moe, "global_parameter_scale=4", "base_num_query_heads=2", "base_num_kv_heads=2")
  assert c.moe_mlp_dim == 64 and c.emb_dim == 32
  layer_moe = 2 * 3 * 32 * 64 + 32 * 4  # two routed experts of width 64, and the router
  attention_proj = 32 * c.head_dim * (2 * c.num_query_heads + 2 * c.num_kv_heads)
  assert metrics.training_flops_per_token(c).matmul == 6 * c.num_decoder_layers * (attention_proj + layer_moe)


def test_flops_deepseek3_671b(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "deepseek3-671b", 4096))
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


def test_flops_deepseek2_16b_plain_query(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "deepseek2-16b", 2048))
  # D=2048 N=16 L=27 (1 dense, F=10944) V=102400; q_lora 0; 64 experts top-6, width 1408, 2 shared
  mla = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048  # 13,762,560
  moe = 6 * 3 * 2048 * 1408 + 3 * 2048 * 1408 * 2 + 2048 * 64  # 69,337,088
  active = 27 * mla + 3 * 2048 * 10944 + 26 * moe
  assert 2.3e9 < active + 2048 * 102400 < 2.5e9  # published: 2.4B activated
  assert flops.matmul == 6 * active
  assert flops.attention == 27 * 3 * 2 * 1024 * 16 * 320


def test_flops_gemma2_2b_alternates_local_and_global(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "gemma2-2b", 8192))
  # D=2304 N=8 K=4 H=256 F=9216 L=26 V=256000 (tied); 13 local layers (window 4096) and 13 global
  assert flops.matmul == 6 * 26 * (2304 * 256 * 24 + 3 * 2304 * 9216)
  assert flops.embedding == 6 * 2304 * 256000
  local_keys = 4096 - 4096**2 / (2 * 8192)  # 3072: the first 4096 queries see fewer keys
  global_keys = 8192 / 2
  assert flops.attention == 3 * 2 * 8 * 512 * (13 * local_keys + 13 * global_keys) == 2_290_089_984
  # a window as long as the sequence is plain causal attention
  short = metrics.training_flops_per_token(preset(tmp_path, "gemma2-2b", 4096))
  assert short.attention == 6 * 26 * 8 * 256 * 4096


def test_flops_gemma3_4b_five_local_one_global(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "gemma3-4b", 4096))
  # L=34: layers 5, 11, 17, 23, 29 global, the other 29 local (window 1024); D=2560 N=8 K=4 H=256 F=10240
  assert flops.matmul == 6 * 34 * (2560 * 256 * 24 + 3 * 2560 * 10240)
  local_keys = 1024 - 1024**2 / (2 * 4096)  # 896
  assert flops.attention == 3 * 2 * 8 * 512 * (29 * local_keys + 5 * 2048) == 890_241_024


def test_flops_mistral_7b_sliding_window(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "mistral-7b", 8192))
  # every layer local, window 4096; D=4096 N=32 K=8 H=128 F=14336 L=32
  assert flops.matmul == 6 * 32 * (4096 * 128 * 80 + 3 * 4096 * 14336)
  assert flops.attention == 32 * 3 * 2 * 3072 * 32 * 256


def test_flops_gpt3_175b(tmp_path):
  flops = metrics.training_flops_per_token(preset(tmp_path, "gpt3-175b", 2048))
  # D=12288 N=K=96 H=128 F=49152 L=96 V=50304, plain GELU MLP (2 matmuls)
  per_layer = 12288 * 128 * 4 * 96 + 2 * 12288 * 49152
  assert 173e9 < 96 * per_layer < 175e9  # GPT-3's 175B, less the embeddings
  assert flops.matmul == 6 * 96 * per_layer
  assert flops.embedding == 6 * 12288 * 50304
  assert flops.attention == 6 * 96 * 96 * 128 * 2048


def built_layer_kinds(cfg):
  """(window, moe, mla) of every layer of the model models/ builds for cfg, in order, from the real
  layer modules (abstractly: nothing allocated)."""
  from flax import nnx

  from MaxText import models
  from MaxText.layers.attention_mla import MLAttention
  from MaxText.layers.moe import MoeBlock

  kinds = []
  for stack in models.family(cfg).stacks(cfg):
    with nnx.use_eager_sharding(False):  # as models.build: no mesh here
      unit = nnx.eval_shape(lambda stack=stack: stack.make(cfg, rngs=nnx.Rngs(0)))
    layers = list(unit.sublayers) if hasattr(unit, "sublayers") else [unit]
    for _ in range(stack.repeats):
      for layer in layers:
        attention = layer.self_attention
        kinds.append((attention.sliding_window, isinstance(layer.mlp, MoeBlock), isinstance(attention, MLAttention)))
  return kinds


@pytest.mark.parametrize(
  "overrides",
  [
    ["decoder_block=gemma2", "base_num_decoder_layers=5", "sliding_window_size=8"],
    ["decoder_block=gemma3", "base_num_decoder_layers=8", "sliding_window_size=8"],
    ["decoder_block=mistral", "sliding_window_size=8"],
    ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"],
    ["decoder_block=deepseek", "base_num_decoder_layers=3", "first_num_dense_layers=1", "num_experts=4"],
    ["decoder_block=gpt3", "trainable_position_size=32"],
  ],
)
def test_layer_kinds_follow_the_built_model(tmp_path, overrides):
  cfg = make_config(tmp_path, "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8", *overrides)
  assert [tuple(k) for k in metrics.layer_kinds(cfg)] == built_layer_kinds(cfg)


def xla_training_flops(cfg, batch_size):
  """XLA's FLOP count (cost analysis) of one forward + backward of the loss on a [batch_size, T] batch."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from MaxText import models, train_step

  graphdef, params = nnx.split(nnx.eval_shape(lambda: models.build(cfg, nnx.Rngs(params=0))), nnx.Param)
  tokens = jax.ShapeDtypeStruct((batch_size, cfg.max_target_length), jnp.int32)
  batch = {k: tokens for k in ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")}
  grad = jax.jit(jax.grad(lambda p, b: train_step.loss_sums(graphdef, cfg, p, b, None)[0]))
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


@pytest.mark.parametrize(
  "overrides",
  [
    [],
    ["base_num_kv_heads=2", "mlp_activations=[gelu]"],
    # MoE: capacity_factor=1 runs exactly tokens x k assignments as einsums XLA can count (ragged_dot it may not)
    ["num_experts=4", "num_experts_per_tok=2", "capacity_factor=1.0", "base_moe_mlp_dim=512"],
    ["decoder_block=deepseek", "q_lora_rank=128", "kv_lora_rank=128", "qk_nope_head_dim=48", "v_head_dim=64"],
  ],
  ids=["dense", "gqa-gelu", "moe", "mla"],
)
def test_flops_match_xla_cost_analysis(tmp_path, overrides):
  cfg = make_config(tmp_path, *TINY_DENSE, *overrides)
  batch_size = 2
  ours = metrics.training_flops_per_token(cfg).total * batch_size * cfg.max_target_length
  xla = xla_training_flops(cfg, batch_size)
  # XLA counts everything we count plus elementwise ops, softmax, norms and the masked upper half of the
  # attention scores (a few percent here: 0.92-0.94 with jax 0.10); a wrong structure is off by far more
  assert 0.88 < ours / xla <= 1.0, (ours, xla)


def test_mfu_and_perplexity():
  # 1e12 FLOPs per step over 2 devices in 0.5 s: 1e12 FLOP/s per device, a quarter of a 4e12 peak
  assert metrics.mfu(1e12, 0.5, 2, 4e12) == pytest.approx(0.25)
  assert metrics.perplexity(2.0) == pytest.approx(math.exp(2.0))
  assert metrics.perplexity(1e4) == math.inf
  assert math.isnan(metrics.perplexity(math.nan))


def run_steps(logger, times, start=0):
  """Log one step per time, numbered by steps completed: start + 1, start + 2, ..."""
  for i, t in enumerate(times):
    step = start + i + 1
    logger.log(step, {"loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "learning_rate": 1e-3, "z_loss": 0.01}, t)


def test_records_every_log_period_and_last_step(tmp_path, capsys):
  cfg = make_config(tmp_path, "steps=25", "log_period=10", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 25)
  records = read_jsonl(cfg.metrics_file)
  assert [r["step"] for r in records] == [1, 2, 10, 20, 25]
  assert [r["compiling"] for r in records] == [True, True, False, False, False]
  keys = {"step", "loss", "perplexity", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s_per_device"}
  keys |= {"tflops_per_s_per_device", "mfu", "eta_s", "elapsed_s", "compiling", "z_loss"}
  assert all(set(r) == keys for r in records)
  # the loss of step 10's record is the mean over its window, steps 3..10 (1 and 2 are compile steps)
  assert records[2]["loss"] == pytest.approx(4.35) and records[2]["perplexity"] == pytest.approx(math.exp(4.35))
  assert records[2]["eta_s"] == pytest.approx(15.0)  # steps 11..25 left at 1 s each
  assert records[0]["eta_s"] is None  # nothing timed yet besides compilation
  out = capsys.readouterr().out
  assert "step 10/25 | loss 4.35 | ppl 77.5 | grad 1 | lr 1.0e-03 | 1 s/step | 500 tok/s/dev" in out
  assert "MFU 12.5% | ETA 15s" in out and "(compiling)" in out and "Training summary" in out


def test_compile_steps_excluded_from_averages(tmp_path):
  cfg = make_config(tmp_path, "steps=12", "log_period=5", "enable_tensorboard=false")
  logger = make_logger(cfg, start_step=3)
  run_steps(logger, [30.0, 20.0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.5, 1.5], start=3)
  summary = logger.close()
  records = read_jsonl(cfg.metrics_file)
  assert [r["step"] for r in records] == [4, 5, 10, 12]
  # own times for the compile steps 4 and 5; then the means of the windows {6..10}, {11, 12}
  assert [r["step_time_s"] for r in records] == pytest.approx([30.0, 20.0, 0.5, 1.5])
  assert summary["steps_run"] == 9
  assert summary["mean_step_time_s"] == pytest.approx(5.5 / 7)
  assert summary["compile_steps_time_s"] == 50.0
  assert summary["final_loss"] == pytest.approx(5.0 - 1.15)  # the mean over the last window, steps 11 and 12
  # 1e12 FLOPs / (5.5/7 s) / 2 devices / 4e12 peak
  assert summary["mfu"] == pytest.approx(1e12 / (5.5 / 7) / 2 / 4e12)
  assert summary["tokens_per_s_per_device"] == pytest.approx(1000 / (5.5 / 7) / 2)


def test_compile_steps_report_no_mfu(tmp_path, capsys):
  cfg = make_config(tmp_path, "steps=6", "log_period=1", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [10.0, 5.0, 1.0, 1.0])
  records = read_jsonl(cfg.metrics_file)
  assert [r["compiling"] for r in records] == [True, True, False, False]
  assert [r["mfu"] for r in records[:2]] == [None, None]
  assert [r["tflops_per_s_per_device"] for r in records[:2]] == [None, None]
  assert records[2]["mfu"] == pytest.approx(1e12 / 1.0 / 2 / 4e12)
  assert records[0]["step_time_s"] == 10.0  # the step time itself is still reported
  assert "| n/a TFLOP/s/dev | MFU n/a | ETA n/a | z_loss 0.01 (compiling)" in capsys.readouterr().out


def test_a_step_that_compiles_later_is_a_compile_step(tmp_path, capsys):
  import jax
  import jax.numpy as jnp

  cfg = make_config(tmp_path, "steps=8", "log_period=1", "enable_tensorboard=false")
  double = jax.jit(lambda x: 2 * x)
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0, 1.0, 1.0])
    logger.log(4, {"loss": 1.0}, 5.0)  # a step with no compilation in it
    double(jnp.ones(3)).block_until_ready()  # compiled between two steps (like an eval step's compile)
    t0 = time.perf_counter()
    double(jnp.ones(4)).block_until_ready()  # a new shape: compiled within the step
    logger.log(5, {"loss": 1.0}, time.perf_counter() - t0)
    t0 = time.perf_counter()
    double(jnp.ones(4)).block_until_ready()  # cached
    logger.log(6, {"loss": 1.0}, time.perf_counter() - t0)
    summary = logger.summary()
  records = read_jsonl(cfg.metrics_file)
  assert [r["compiling"] for r in records] == [True, True, False, False, True, False]
  assert records[4]["mfu"] is None and records[5]["mfu"] is not None
  assert summary["steps_run"] == 6
  assert summary["compile_steps_time_s"] == pytest.approx(2.0 + records[4]["step_time_s"])
  assert summary["mean_step_time_s"] == pytest.approx((1.0 + 5.0 + records[5]["step_time_s"]) / 3)


def test_eval_records_and_non_writer(tmp_path, capsys):
  cfg = make_config(tmp_path, "steps=4", "log_period=2", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 3)
    logger.log_eval(2, {"loss": 3.0})
  last = read_jsonl(cfg.metrics_file)[-1]
  assert last["eval_loss"] == 3.0 and last["eval_perplexity"] == pytest.approx(math.exp(3.0))
  assert logger.close()["eval_loss"] == 3.0  # close is idempotent

  other = make_config(tmp_path / "other", "steps=4", "log_period=2")
  capsys.readouterr()
  with make_logger(other, is_writer=False) as logger:
    run_steps(logger, [1.0] * 4)
    logger.log_eval(3, {"eval_loss": 3.0})
  assert capsys.readouterr().out == ""
  assert not os.path.exists(other.run_dir)


def test_non_finite_loss_is_null_in_json(tmp_path):
  cfg = make_config(tmp_path, "steps=2", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    logger.log(1, {"loss": math.nan}, 1.0)
    logger.log(2, {"loss": 1e4}, 1.0)
  records = read_jsonl(cfg.metrics_file)
  assert records[0]["loss"] is None and records[1]["perplexity"] is None


def test_tensorboard_event_file(tmp_path):
  cfg = make_config(tmp_path, "steps=3", "log_period=1")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 3)
  assert glob.glob(os.path.join(cfg.tensorboard_dir, "events.out.tfevents*"))


def test_window_means_are_token_weighted(tmp_path):
  cfg = make_config(tmp_path, "steps=6", "log_period=3", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0, 1.0])  # the compile steps, logged alone
    for step, loss, tokens, grad in ((3, 1.0, 100.0, 1.0), (4, 9.0, 100.0, 2.0), (5, 4.0, 300.0, 6.0)):
      logger.log(step, {"loss": loss, "tokens": tokens, "grad_norm": grad, "learning_rate": step * 1e-3}, 1.0)
    logger.log(6, {"loss": 2.0, "tokens": 50.0, "grad_norm": 1.0, "learning_rate": 6e-3}, 1.0)
  records = read_jsonl(cfg.metrics_file)
  assert [r["step"] for r in records] == [1, 2, 3, 6]
  assert records[2]["loss"] == 1.0  # a window of one step
  window = records[3]  # steps 4, 5, 6
  assert window["loss"] == pytest.approx((9.0 * 100 + 4.0 * 300 + 2.0 * 50) / 450)
  assert window["grad_norm"] == pytest.approx(3.0)  # a plain mean
  assert window["learning_rate"] == 6e-3  # the last step's


def test_measured_peak_is_raised_so_mfu_stays_below_one(tmp_path, capsys):
  cfg = make_config(tmp_path, "steps=4", "log_period=1", "enable_tensorboard=false")
  # 1e12 FLOPs in 0.1 s on 2 devices is 5e12 FLOP/s per device, more than the measured 4e12
  with make_logger(cfg, peak_is_measured=True) as logger:
    run_steps(logger, [1.0, 1.0, 0.1, 0.2])
  records = read_jsonl(cfg.metrics_file)
  assert records[2]["mfu"] == pytest.approx(1.0) and records[3]["mfu"] == pytest.approx(0.5)
  assert logger.summary()["peak_tflops_per_s_per_device"] == pytest.approx(5.0)
  assert "beats the measured peak" in capsys.readouterr().out
  with make_logger(make_config(tmp_path / "table", "steps=3", "enable_tensorboard=false")) as logger:
    run_steps(logger, [1.0, 1.0, 0.1])  # a table peak is not raised: MFU > 1 would mean wrong FLOPs
  assert logger.summary()["peak_tflops_per_s_per_device"] == pytest.approx(4.0)


def test_no_tensorboard_file_without_records(tmp_path):
  cfg = make_config(tmp_path, "steps=3", "log_period=1")
  with make_logger(cfg, start_step=3):
    pass
  assert not os.path.exists(cfg.tensorboard_dir)


def test_summary_names_the_outputs(tmp_path, capsys):
  cfg = make_config(tmp_path, "steps=2", "enable_tensorboard=true")
  with make_logger(cfg, started=time.perf_counter() - 75.0) as logger:
    run_steps(logger, [1.0, 1.0])
    logger.log_checkpoint(2, "/ckpt/2/state")
  out = capsys.readouterr().out
  assert "step 2/2 | checkpoint saved: /ckpt/2/state" in out
  assert "total time           1m15s" in out  # counted from `started`, not from the logger's creation
  assert "load_parameters_path=/ckpt/2/state" in out and f"tensorboard --logdir {cfg.tensorboard_dir}" in out
  assert f"python3 -m MaxText.plot_metrics {cfg.metrics_file}" in out


def test_plot_writes_png(tmp_path):
  cfg = make_config(tmp_path, "steps=30", "log_period=5", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 30)
    logger.log_eval(30, {"loss": 2.5})
  output = tmp_path / "plots" / "loss.png"
  plot_metrics.main(["plot_metrics.py", cfg.metrics_file, "--output", str(output)])
  with open(output, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert output.stat().st_size > 1000


def test_plot_smoothing():
  assert plot_metrics.smooth([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
  assert plot_metrics.smooth([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])  # debiased: no pull to 0
  got = plot_metrics.smooth([0.0, 10.0], 0.5)
  assert got[0] == 0.0 and 0.0 < got[1] < 10.0
  with pytest.raises(SystemExit):
    plot_metrics.main(["plot_metrics.py", "unused.jsonl", "--smoothing", "1.5"])


def test_compiles_belong_to_the_step_whose_dispatch_they_end_in(tmp_path):
  """The async loop logs step N after dispatching step N+1: a compile during N+1's dispatch is N+1's."""
  import jax
  import jax.numpy as jnp

  cfg = make_config(tmp_path, "steps=8", "log_period=1", "enable_tensorboard=false")
  triple = jax.jit(lambda x: 3 * x)

  def dispatch(size):
    t0 = time.perf_counter()
    triple(jnp.ones(size)).block_until_ready()
    return t0, time.perf_counter()

  with make_logger(cfg) as logger:
    run_steps(logger, [1.0, 1.0])
    window3 = dispatch(5)  # new shape: compiles
    window4 = dispatch(6)  # new shape, dispatched before step 3 is logged
    logger.log(3, {"loss": 1.0}, 1.0, dispatch=window3)
    window5 = dispatch(6)  # cached
    logger.log(4, {"loss": 1.0}, 1.0, dispatch=window4)
    logger.log(5, {"loss": 1.0}, 1.0, dispatch=window5)
  records = read_jsonl(cfg.metrics_file)
  assert [r["compiling"] for r in records] == [True, True, True, True, False]
