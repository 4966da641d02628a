"""The metric writers and the plot script (the FLOP count and MFU: flops_test.py)."""

import glob
import json
import math
import os
import time

import pytest

from MaxText import metrics, plot_metrics
from MaxText.tests.conftest import sized_config

pytestmark = pytest.mark.usefixtures("no_compile_cache")  # these tests count compilations: no cache hits


def make_logger(cfg, **kwargs):
  args = dict(
    num_devices=2, tokens_per_step=1000, flops_per_step=1e12, peak_flops_per_device=4e12, start_step=0, is_writer=True
  )
  return metrics.MetricLogger(cfg, **{**args, **kwargs})


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_perplexity():
  assert metrics.perplexity(2.0) == pytest.approx(math.exp(2.0))
  assert metrics.perplexity(1e4) == math.inf
  assert math.isnan(metrics.perplexity(math.nan))


def run_steps(logger, times, start=0):
  """Log one step per time, numbered by steps completed: start + 1, start + 2, ..."""
  for i, t in enumerate(times):
    step = start + i + 1
    logger.log(step, {"loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "learning_rate": 1e-3, "z_loss": 0.01}, t)


def test_records_every_log_period_and_last_step(tmp_path, capsys):
  cfg = sized_config(tmp_path, "steps=25", "log_period=10", "enable_tensorboard=false")
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
  cfg = sized_config(tmp_path, "steps=12", "log_period=5", "enable_tensorboard=false")
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
  cfg = sized_config(tmp_path, "steps=6", "log_period=1", "enable_tensorboard=false")
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

  cfg = sized_config(tmp_path, "steps=8", "log_period=1", "enable_tensorboard=false")
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
  cfg = sized_config(tmp_path, "steps=4", "log_period=2", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 3)
    logger.log_eval(2, {"loss": 3.0})
  last = read_jsonl(cfg.metrics_file)[-1]
  assert last["eval_loss"] == 3.0 and last["eval_perplexity"] == pytest.approx(math.exp(3.0))
  assert logger.close()["eval_loss"] == 3.0  # close is idempotent

  other = sized_config(tmp_path / "other", "steps=4", "log_period=2")
  capsys.readouterr()
  with make_logger(other, is_writer=False) as logger:
    run_steps(logger, [1.0] * 4)
    logger.log_eval(3, {"eval_loss": 3.0})
  assert capsys.readouterr().out == ""
  assert not os.path.exists(other.run_dir)


def test_non_finite_loss_is_null_in_json(tmp_path):
  cfg = sized_config(tmp_path, "steps=2", "enable_tensorboard=false")
  with make_logger(cfg) as logger:
    logger.log(1, {"loss": math.nan}, 1.0)
    logger.log(2, {"loss": 1e4}, 1.0)
  records = read_jsonl(cfg.metrics_file)
  assert records[0]["loss"] is None and records[1]["perplexity"] is None


def test_tensorboard_event_file(tmp_path):
  cfg = sized_config(tmp_path, "steps=3", "log_period=1")
  with make_logger(cfg) as logger:
    run_steps(logger, [1.0] * 3)
  assert glob.glob(os.path.join(cfg.tensorboard_dir, "events.out.tfevents*"))


def test_window_means_are_token_weighted(tmp_path):
  cfg = sized_config(tmp_path, "steps=6", "log_period=3", "enable_tensorboard=false")
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
  cfg = sized_config(tmp_path, "steps=4", "log_period=1", "enable_tensorboard=false")
  # 1e12 FLOPs in 0.1 s on 2 devices is 5e12 FLOP/s per device, more than the measured 4e12
  with make_logger(cfg, peak_is_measured=True) as logger:
    run_steps(logger, [1.0, 1.0, 0.1, 0.2])
  records = read_jsonl(cfg.metrics_file)
  assert records[2]["mfu"] == pytest.approx(1.0) and records[3]["mfu"] == pytest.approx(0.5)
  assert logger.summary()["peak_tflops_per_s_per_device"] == pytest.approx(5.0)
  assert "beats the measured peak" in capsys.readouterr().out
  with make_logger(sized_config(tmp_path / "table", "steps=3", "enable_tensorboard=false")) as logger:
    run_steps(logger, [1.0, 1.0, 0.1])  # a table peak is not raised: MFU > 1 would mean wrong FLOPs
  assert logger.summary()["peak_tflops_per_s_per_device"] == pytest.approx(4.0)


def test_no_tensorboard_file_without_records(tmp_path):
  cfg = sized_config(tmp_path, "steps=3", "log_period=1")
  with make_logger(cfg, start_step=3):
    pass
  assert not os.path.exists(cfg.tensorboard_dir)


def test_summary_names_the_outputs(tmp_path, capsys):
  cfg = sized_config(tmp_path, "steps=2", "enable_tensorboard=true")
  with make_logger(cfg, started=time.perf_counter() - 75.0) as logger:
    run_steps(logger, [1.0, 1.0])
    logger.log_checkpoint(2, "/ckpt/2/state")
  out = capsys.readouterr().out
  assert "step 2/2 | checkpoint saved: /ckpt/2/state" in out
  assert "total time           1m15s" in out  # counted from `started`, not from the logger's creation
  assert "load_parameters_path=/ckpt/2/state" in out and f"tensorboard --logdir {cfg.tensorboard_dir}" in out
  assert f"python3 -m MaxText.plot_metrics {cfg.metrics_file}" in out


def test_plot_writes_png(tmp_path):
  cfg = sized_config(tmp_path, "steps=30", "log_period=5", "enable_tensorboard=false")
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

  cfg = sized_config(tmp_path, "steps=8", "log_period=1", "enable_tensorboard=false")
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
