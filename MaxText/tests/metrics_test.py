"""FLOP count, MFU arithmetic, the metric writers and the plot script."""

import glob
import json
import math
import os

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


def test_mfu_and_perplexity():
  # 1e12 FLOPs per step over 2 devices in 0.5 s: 1e12 FLOP/s per device, a quarter of a 4e12 peak
  assert metrics.mfu(1e12, 0.5, 2, 4e12) == pytest.approx(0.25)
  assert metrics.perplexity(2.0) == pytest.approx(math.exp(2.0))
  assert metrics.perplexity(1e4) == math.inf
  assert math.isnan(metrics.perplexity(math.nan))


def run_steps(logger, times, start=0):
  for i, t in enumerate(times):
    step = start + i
    logger.log(step, {"loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "learning_rate": 1e-3, "z_loss": 0.01}, t)


def test_records_every_log_period_and_last_step(tmp_path, capsys):
  cfg = make_config(tmp_path, "steps=25", "log_period=10", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 25)
  records = read_jsonl(cfg.metrics_file)
  assert [r["step"] for r in records] == [0, 1, 10, 20, 24]
  assert [r["compiling"] for r in records] == [True, True, False, False, False]
  keys = {"step", "loss", "perplexity", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s_per_device"}
  keys |= {"tflops_per_s_per_device", "mfu", "eta_s", "elapsed_s", "compiling", "z_loss"}
  assert all(set(r) == keys for r in records)
  assert records[2]["loss"] == pytest.approx(4.0) and records[2]["perplexity"] == pytest.approx(math.exp(4.0))
  assert records[2]["eta_s"] == pytest.approx(14.0)  # steps 11..24 left at 1 s each
  assert records[0]["eta_s"] is None  # nothing timed yet besides compilation
  out = capsys.readouterr().out
  assert "step 10/25 | loss 4 | ppl 54.6 | grad 1 | lr 1.0e-03 | 1 s/step | 500 tok/s/dev" in out
  assert "MFU 12.5% | ETA 14s" in out and "(compiling)" in out and "Training summary" in out


def test_compile_steps_excluded_from_averages(tmp_path):
  cfg = make_config(tmp_path, "steps=12", "log_period=5", "enable_tensorboard=false")
  logger = make_logger(cfg, start_step=3)
  run_steps(logger, [30.0, 20.0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.5, 1.5], start=3)
  summary = logger.close()
  records = read_jsonl(cfg.metrics_file)
  assert [r["step"] for r in records] == [3, 4, 5, 10, 11]
  # own times for the compile steps 3 and 4; then the means of the windows {5}, {6..10}, {11}
  assert [r["step_time_s"] for r in records] == pytest.approx([30.0, 20.0, 0.5, 0.7, 1.5])
  assert summary["steps_run"] == 9
  assert summary["mean_step_time_s"] == pytest.approx(5.5 / 7)
  assert summary["compile_steps_time_s"] == 50.0
  assert summary["final_loss"] == pytest.approx(5.0 - 1.1)
  # 1e12 FLOPs / (5.5/7 s) / 2 devices / 4e12 peak
  assert summary["mfu"] == pytest.approx(1e12 / (5.5 / 7) / 2 / 4e12)
  assert summary["tokens_per_s_per_device"] == pytest.approx(1000 / (5.5 / 7) / 2)


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
    logger.log(0, {"loss": math.nan}, 1.0)
    logger.log(1, {"loss": 1e4}, 1.0)
  records = read_jsonl(cfg.metrics_file)
  assert records[0]["loss"] is None and records[1]["perplexity"] is None


def test_tensorboard_event_file(tmp_path):
  cfg = make_config(tmp_path, "steps=3", "log_period=1")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 3)
  assert glob.glob(os.path.join(cfg.tensorboard_dir, "events.out.tfevents*"))


def test_plot_writes_png(tmp_path):
  cfg = make_config(tmp_path, "steps=30", "log_period=5", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 30)
    logger.log_eval(29, {"loss": 2.5})
  output = tmp_path / "plots" / "loss.png"
  assert plot_metrics.main([cfg.metrics_file, "--output", str(output)]) == 0
  with open(output, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert output.stat().st_size > 1000
