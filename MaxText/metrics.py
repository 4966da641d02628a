"""Training FLOPs, MFU and the metric writers (stdout, JSON lines, TensorBoard).

The train loop hands `MetricLogger.log` host floats once per step; the logger never touches a
device, so it adds no synchronisation. Records go out every `log_period` steps, at the last step,
and for the first two steps of a run (which include compilation and are kept out of averages).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from MaxText.config import Config

COMPILE_STEPS = 2  # the first steps after start include jit compilation; timed apart
MAX_EXP_ARG = 709.0  # math.exp overflows a float64 just above this


class FlopCount(NamedTuple):
  """Training FLOPs per token (forward + backward); `total` is the sum of the three parts."""

  total: float
  matmul: float  # decoder-layer weight matmuls (attention projections and MLP)
  attention: float  # the QK^T and AV matmuls of causal self-attention
  embedding: float  # the output (unembedding) projection; the input lookup is not a matmul


def training_flops_per_token(config: Config) -> FlopCount:
  """Model FLOPs per trained token, forward + backward (3x the forward), the standard 6·N count.

  With D emb_dim, N query heads, K kv heads, H head_dim, F mlp_dim, A len(mlp_activations),
  L layers, V vocab_size, T max_target_length:
    matmul    = 6·L·(D·H·(2N + 2K) + (A + 1)·D·F)   q,o: D·N·H each; k,v: D·K·H each; A MLP
                                                    input projections + 1 output, D·F each
    embedding = 6·D·V                               the logits projection (tied or not)
    attention = 6·L·N·H·T                           QK^T and AV: 2 matmuls x 2 FLOPs x T·H·N
                                                    forward = 4·T·H·N, x3 fwd+bwd, /2 causal
  2 FLOPs per multiply-add in the forward and 4 in the backward give the 6 per parameter.
  """
  d, h, f, v, t = config.emb_dim, config.head_dim, config.mlp_dim, config.vocab_size, config.max_target_length
  n, k, layers = config.num_query_heads, config.num_kv_heads, config.num_decoder_layers
  params_per_layer = d * h * (2 * n + 2 * k) + (len(config.mlp_activations) + 1) * d * f
  matmul = 6.0 * layers * params_per_layer
  embedding = 6.0 * d * v
  attention = 6.0 * layers * n * h * t
  return FlopCount(matmul + attention + embedding, matmul, attention, embedding)


def perplexity(loss: float) -> float:
  """exp(loss); inf instead of an OverflowError for a diverged loss, nan for a nan loss."""
  return math.inf if loss > MAX_EXP_ARG else math.exp(loss)


def mfu(flops_per_step: float, step_time_s: float, num_devices: int, peak_flops_per_device: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak (a fraction)."""
  return flops_per_step / step_time_s / num_devices / peak_flops_per_device


def format_duration(seconds: float) -> str:
  """45s, 1m14s, 2h03m."""
  s = max(0, int(round(seconds)))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _mean(values: list[float]) -> float | None:
  return sum(values) / len(values) if values else None


def _json_safe(value: Any) -> Any:
  """Strict JSON has no inf/nan: write them as null."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class MetricLogger:
  """Per-step metrics -> stdout, `config.metrics_file` (JSON lines) and TensorBoard.

  Only the writer process (jax.process_index() == 0) prints or writes; the others just keep the
  running sums so that `close()` returns the same summary everywhere. Use as a context manager or
  call `close()`.
  """

  def __init__(
    self,
    config: Config,
    *,
    num_devices: int,
    tokens_per_step: float,
    flops_per_step: float,
    peak_flops_per_device: float,
    start_step: int,
    is_writer: bool,
  ):
    """tokens_per_step and flops_per_step are global (all devices); peak_flops_per_device in FLOP/s."""
    self.config = config
    self.num_devices = num_devices
    self.tokens_per_step = tokens_per_step
    self.flops_per_step = flops_per_step
    self.peak_flops_per_device = peak_flops_per_device
    self.start_step = start_step
    self.is_writer = is_writer
    self._start_time = time.perf_counter()
    self._steps_run = 0
    self._window: list[float] = []  # step times since the last record, compile steps excluded
    self._timed_s, self._timed_steps = 0.0, 0  # totals over all steps, compile steps excluded
    self._compile_time_s = 0.0
    self._last: dict[str, float] = {}
    self._last_eval: dict[str, float] = {}
    self._closed = False
    self._file = None
    self._tb = None
    if is_writer:
      self._open_writers()

  def _open_writers(self) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(self.config.metrics_file)), exist_ok=True)
    self._file = open(self.config.metrics_file, "a")  # a resumed run appends to its own file
    if self.config.enable_tensorboard:
      from tensorboardX import SummaryWriter  # lazy: pulls in protobuf; only the writer needs it

      self._tb = SummaryWriter(logdir=self.config.tensorboard_dir)

  def __enter__(self) -> MetricLogger:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def log(self, step: int, scalars: Mapping[str, float], step_time_s: float) -> None:
    """Record one finished step. `scalars` are host floats (loss, grad_norm, learning_rate, ...);
    `step_time_s` is the wall time of that step in seconds, as measured by the caller."""
    compiling = self._steps_run < COMPILE_STEPS
    self._steps_run += 1
    self._last = {k: float(v) for k, v in scalars.items()}
    if compiling:
      self._compile_time_s += step_time_s
      self._emit(self._train_record(step, step_time_s, compiling=True))
      return
    self._window.append(step_time_s)
    self._timed_s, self._timed_steps = self._timed_s + step_time_s, self._timed_steps + 1
    if step % self.config.log_period == 0 or step == self.config.steps - 1:
      self._emit(self._train_record(step, _mean(self._window), compiling=False))
      self._window = []

  def log_eval(self, step: int, scalars: Mapping[str, float]) -> None:
    """Write eval metrics now; keys get an `eval_` prefix, and eval_perplexity follows eval_loss."""
    record: dict[str, Any] = {"step": int(step)}
    for key, value in scalars.items():
      record[key if key.startswith("eval_") else f"eval_{key}"] = float(value)
    if "eval_loss" in record:
      record["eval_perplexity"] = perplexity(record["eval_loss"])
    record["elapsed_s"] = time.perf_counter() - self._start_time
    self._last_eval = {k: v for k, v in record.items() if k.startswith("eval_")}
    self._emit(record)

  def _train_record(self, step: int, step_time_s: float, compiling: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"step": int(step), **self._last}
    if "loss" in record:
      record["perplexity"] = perplexity(record["loss"])
    record.update(self._throughput(step_time_s))
    mean_step = self._mean_step_time()  # compile-step times would inflate the ETA many times over
    record["eta_s"] = None if mean_step is None else max(0, self.config.steps - 1 - step) * mean_step
    record["elapsed_s"] = time.perf_counter() - self._start_time
    record["compiling"] = compiling
    return record

  def _mean_step_time(self) -> float | None:
    return self._timed_s / self._timed_steps if self._timed_steps else None

  def _throughput(self, step_time_s: float | None) -> dict[str, float | None]:
    """Per-device rates for a mean step time (None when no step has been timed)."""
    if not step_time_s:
      return dict.fromkeys(("step_time_s", "tokens_per_s_per_device", "tflops_per_s_per_device", "mfu"))
    return {
      "step_time_s": step_time_s,
      "tokens_per_s_per_device": self.tokens_per_step / step_time_s / self.num_devices,
      "tflops_per_s_per_device": self.flops_per_step / step_time_s / self.num_devices / 1e12,
      "mfu": mfu(self.flops_per_step, step_time_s, self.num_devices, self.peak_flops_per_device),
    }

  def _emit(self, record: dict[str, Any]) -> None:
    if not self.is_writer:
      return
    print(format_record(record, self.config.steps), flush=True)
    self._file.write(json.dumps({k: _json_safe(v) for k, v in record.items()}, allow_nan=False) + "\n")
    self._file.flush()
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
          self._tb.add_scalar(_tb_tag(key), value, record["step"])
      self._tb.flush()

  def summary(self) -> dict[str, Any]:
    """Run totals; timing means exclude the compile steps (None when no step was timed)."""
    mean_step = self._mean_step_time()
    rates = self._throughput(mean_step)
    return {
      "steps_run": self._steps_run,
      "final_loss": self._last.get("loss"),
      "mean_step_time_s": mean_step,
      "tokens_per_s_per_device": rates["tokens_per_s_per_device"],
      "tflops_per_s_per_device": rates["tflops_per_s_per_device"],
      "mfu": rates["mfu"],
      "compile_steps_time_s": self._compile_time_s,
      "total_time_s": time.perf_counter() - self._start_time,
      **self._last_eval,
    }

  def close(self) -> dict[str, Any]:
    """Flush and close the writers, print the summary (writer only) and return it. Idempotent."""
    result = self.summary()
    if self._closed:
      return result
    self._closed = True
    if self.is_writer:
      print(format_summary(result), flush=True)
      self._file.close()
      if self._tb is not None:
        self._tb.close()
    return result


def _tb_tag(key: str) -> str:
  """TensorBoard groups: perf/*, eval/*, train/*."""
  if key.startswith("eval_"):
    return f"eval/{key[len('eval_') :]}"
  if key in ("step_time_s", "tokens_per_s_per_device", "tflops_per_s_per_device", "mfu", "eta_s", "elapsed_s"):
    return f"perf/{key}"
  return f"train/{key}"


def _num(value: float | None, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)


def format_record(record: Mapping[str, Any], total_steps: int) -> str:
  """One readable line: `step 120/300 | loss 4.512 | ppl 91.1 | ... | MFU 41.2% | ETA 1m14s`."""
  r = dict(record)
  head = "eval step" if any(k.startswith("eval_") for k in r) else "step"
  parts = [f"{head} {r.pop('step')}/{total_steps}"]
  named = {
    "loss": ("loss", ".4g"),
    "perplexity": ("ppl", ",.1f"),
    "eval_loss": ("loss", ".4g"),
    "eval_perplexity": ("ppl", ",.1f"),
    "grad_norm": ("grad", ".3g"),
    "learning_rate": ("lr", ".1e"),
  }
  for key, (label, spec) in named.items():
    if key in r:
      parts.append(f"{label} {_num(r.pop(key), spec)}")
  if "step_time_s" in r:
    parts.append(f"{_num(r.pop('step_time_s'), '.3g')} s/step")
    parts.append(f"{_num(r.pop('tokens_per_s_per_device'), ',.0f')} tok/s/dev")
    parts.append(f"{_num(r.pop('tflops_per_s_per_device'), '.3g')} TFLOP/s/dev")
    mfu_value = r.pop("mfu")
    parts.append(f"MFU {_num(None if mfu_value is None else 100 * mfu_value, '.1f')}%")
  if "eta_s" in r:
    eta = r.pop("eta_s")
    parts.append(f"ETA {'n/a' if eta is None else format_duration(eta)}")
  r.pop("elapsed_s", None)
  compiling = r.pop("compiling", False)
  parts += [f"{k} {_num(v, '.4g')}" for k, v in r.items() if isinstance(v, (int, float))]
  return " | ".join(parts) + (" (compiling)" if compiling else "")


def format_summary(summary: Mapping[str, Any]) -> str:
  mfu_value = summary["mfu"]
  lines = [
    "Training summary (timing excludes the compile steps)",
    f"  steps run            {summary['steps_run']}",
    f"  final loss           {_num(summary['final_loss'], '.4f')}",
    f"  mean step time       {_num(summary['mean_step_time_s'], '.4g')} s",
    f"  tokens/s/device      {_num(summary['tokens_per_s_per_device'], ',.0f')}",
    f"  TFLOP/s/device       {_num(summary['tflops_per_s_per_device'], '.4g')}",
    f"  MFU                  {_num(None if mfu_value is None else 100 * mfu_value, '.2f')}%",
    f"  compile steps time   {format_duration(summary['compile_steps_time_s'])}",
    f"  total time           {format_duration(summary['total_time_s'])}",
  ]
  if "eval_loss" in summary:
    lines.append(f"  final eval loss      {_num(summary['eval_loss'], '.4f')}")
  return "\n".join(lines)


if __name__ == "__main__":
  from MaxText import config as config_lib

  flops = training_flops_per_token(config_lib.load(sys.argv[1:]))
  print(f"training FLOPs per token: {flops.total:.4g} ({flops._asdict()})")
