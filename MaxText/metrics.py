"""The metric writers (stdout, JSON lines, TensorBoard); the model FLOPs behind TFLOP/s and MFU are
MaxText/flops.py's.

The train loop hands `MetricLogger.log` host floats once per step (one step late: it reads step N's
metrics after dispatching step N+1); the logger never touches a device, so it adds no
synchronisation. Steps are numbered by steps completed (1 .. steps), as checkpoints are named: the
record of step 400 is the one whose update made state.step 400, and an eval at step 400 evaluates
the parameters checkpoint 400 holds. Records go out every `log_period` steps, at the last step, and
for every step that includes compilation: the first two steps of a run, and any later step during
whose dispatch JAX finished compiling something (e.g. a new input shape). Those are kept out of the
averages and report no TFLOP/s or MFU: their time is mostly compiling, not model FLOPs.

A record's loss (and z_loss, moe_load_balance_loss, mtp_loss) is the token-weighted mean over the steps since the
previous record, and grad_norm the plain mean, matching step_time_s, a window mean too: one step's
loss is noisy, so logging it alone makes a smooth run look erratic. learning_rate is the last step's.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from MaxText import console, goodput, paths
from MaxText.config import Config
from MaxText.console import format_duration
from MaxText.flops import mfu

COMPILE_STEPS = 2  # the first steps after start include jit compilation; timed apart
# jax.monitoring event recorded when an XLA compilation ends (jax._src.dispatch.BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MAX_EXP_ARG = 709.0  # math.exp overflows a float64 just above this
# per-token losses (GRPO: kl, clip_fraction): token-weighted over a window
TOKEN_MEANS = ("loss", "z_loss", "moe_load_balance_loss", "mtp_loss", "kl", "clip_fraction")
# per-step values (GRPO: its batches' rewards and lengths): plain mean over a window
PLAIN_MEANS = ("grad_norm", "reward_mean", "reward_std", "completion_length", "decode_steps", "sample_time_s")
# Per-step 0/1 flags from the train step: counted into `skipped_steps`, not written per step.
STEP_FLAGS = ("update_finite", "step_skipped")


def perplexity(loss: float) -> float:
  """exp(loss); inf instead of an OverflowError for a diverged loss, nan for a nan loss."""
  return math.inf if loss > MAX_EXP_ARG else math.exp(loss)


def _mean(values: list[float]) -> float | None:
  return sum(values) / len(values) if values else None


def _json_safe(value: Any) -> Any:
  """Strict JSON has no inf/nan: write them as null."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class Window:
  """Running sums of the steps since the last record (compile steps are not added)."""

  def __init__(self):
    self.times: list[float] = []
    self.tokens = 0.0
    self.weighted: dict[str, float] = {}  # sum of value x tokens, TOKEN_MEANS keys
    self.plain: dict[str, list[float]] = {}  # PLAIN_MEANS keys

  def add(self, scalars: Mapping[str, float], step_time_s: float) -> None:
    self.times.append(step_time_s)
    tokens = float(scalars.get("tokens", 1.0)) or 1.0  # older step functions report no token count
    self.tokens += tokens
    for key in TOKEN_MEANS:
      if key in scalars:
        self.weighted[key] = self.weighted.get(key, 0.0) + float(scalars[key]) * tokens
    for key in PLAIN_MEANS:
      if key in scalars:
        self.plain.setdefault(key, []).append(float(scalars[key]))

  def means(self) -> dict[str, float]:
    out = {k: v / self.tokens for k, v in self.weighted.items()}
    out.update({k: sum(v) / len(v) for k, v in self.plain.items()})
    return out


class MetricLogger:
  """Per-step metrics -> stdout, `config.metrics_file` (JSON lines) and TensorBoard.

  Only the writer process (jax.process_index() == 0) prints or writes; the others just keep the
  running sums so that `close()` returns the same summary everywhere. Use as a context manager or
  call `close()`. The TensorBoard writer is opened at the first record, so a run that logs nothing
  leaves no empty events file.
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
    peak_is_measured: bool = False,
    started: float | None = None,
    progress: bool = False,
    goodput_figures: Callable[[], dict[str, Any]] | None = None,
    perplexity: bool = True,
    sample_prompt: str | None = None,
  ):
    """tokens_per_step and flops_per_step are global (all devices); peak_flops_per_device in FLOP/s.
    peak_is_measured: the peak is a measured matmul (CPU), a lower bound that a window beating it
    raises, so MFU never exceeds 100%. started: perf_counter() when the run began (default: now), the
    origin of elapsed_s and total_time_s. progress: show console.Progress between records. goodput_figures:
    the run's goodput fields so far (goodput.Recorder.figures), added to every train record and the summary.
    perplexity: the loss is a language-model nll (Objective.perplexity): records show exp(loss) too.
    sample_prompt: the summary's decode command samples from it (the data's first held-out words)."""
    self.config = config
    self.perplexity = perplexity
    self.sample_prompt = sample_prompt
    self.num_devices = num_devices
    self.tokens_per_step = tokens_per_step
    self.flops_per_step = flops_per_step
    self.peak_flops_per_device = peak_flops_per_device
    self.peak_is_measured = peak_is_measured
    self.start_step = start_step
    self.is_writer = is_writer
    self._start_time = time.perf_counter() if started is None else started
    self._steps_run = 0
    self._window = Window()
    self._timed_s, self._timed_steps = 0.0, 0  # totals over all steps, compile steps excluded
    self._compile_time_s = 0.0
    self._last: dict[str, float] = {}  # the last step's scalars
    self._last_record: dict[str, Any] = {}  # the last train record written
    self._skipped = 0  # steps whose update was not applied (non-finite or a spike), this run
    self._last_eval: dict[str, float] = {}
    self._last_checkpoint: str | None = None
    self._closed = False
    self._compiles: list[float] = []  # perf_counter() at the end of each compilation since the last log
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    self._file = None
    self._tb = None
    self._tb_mirror: paths.DirMirror | None = None  # a gs:// tensorboard_dir: events written locally, copied up
    self._goodput_figures = goodput_figures
    self._progress = console.Progress(config.steps, start_step, enabled=is_writer and progress)
    if is_writer:
      self._file = paths.AppendFile(config.metrics_file)  # a resumed run appends to its own file (local or gs://)

  def _tensorboard(self) -> Any:
    """The TensorBoard writer, opened on first use (a resume appends a new events file to the same logdir,
    which TensorBoard reads as one run)."""
    if self._tb is None and self.config.enable_tensorboard:
      from tensorboardX import SummaryWriter  # lazy: pulls in protobuf; only the writer needs it

      logdir, self._tb_mirror = paths.writable_dir(self.config.tensorboard_dir)
      self._tb = SummaryWriter(logdir=logdir)
    return self._tb

  def __enter__(self) -> MetricLogger:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def _on_event(self, event: str, duration_s: float, **_: Any) -> None:
    if event == BACKEND_COMPILE_EVENT:
      self._compiles.append(time.perf_counter())

  def _compiled_during(self, start: float, end: float) -> bool:
    """Whether a compilation ended within [start, end] (perf_counter() seconds). Compilations that ended
    before `end` are forgotten; later ones are kept for the next steps (the loop dispatches step N+1
    before it logs step N). Compilations outside every step's window (an eval step's) are not counted."""
    compiles = self._compiles
    self._compiles = [t for t in compiles if t > end]
    return any(start <= t <= end for t in compiles)

  def log(
    self, step: int, scalars: Mapping[str, float], step_time_s: float, dispatch: tuple[float, float] | None = None
  ) -> None:
    """Record one finished step; `step` counts steps completed (1 for the first step of a fresh run).
    `scalars` are host floats (loss, grad_norm, learning_rate, tokens, ...); `step_time_s` is the wall
    time of that step in seconds, as measured by the caller. `dispatch` is the (start, end)
    perf_counter() interval in which the caller dispatched the step: a compilation ending within it
    marks the step as compiling. Without it the caller calls this right after the step and the window
    is the last `step_time_s` seconds."""
    now = time.perf_counter()
    start, end = dispatch if dispatch is not None else (now - step_time_s, now)
    compiling = self._compiled_during(start, end) or self._steps_run < COMPILE_STEPS
    self._steps_run += 1
    self._skipped += int(scalars.get("step_skipped", 0.0) > 0)
    self._last = {k: float(v) for k, v in scalars.items() if k not in STEP_FLAGS}
    if self._skipped:  # only runs that skipped a step carry the count, so normal log lines stay short
      self._last["skipped_steps"] = self._skipped
    if compiling:
      self._compile_time_s += step_time_s
      self._emit(self._train_record(step, step_time_s, self._last, compiling=True))
    else:
      self._window.add(self._last, step_time_s)
      self._timed_s, self._timed_steps = self._timed_s + step_time_s, self._timed_steps + 1
      if step % self.config.log_period == 0 or step == self.config.steps:
        window, self._window = self._window, Window()
        self._emit(self._train_record(step, _mean(window.times), {**self._last, **window.means()}, compiling=False))
    mean_step = self._mean_step_time()
    eta = None if mean_step is None else max(0, self.config.steps - step) * mean_step
    self._progress.update(step, self._last.get("loss"), eta)

  def log_eval(self, step: int, scalars: Mapping[str, float]) -> None:
    """Write eval metrics now (`step`: steps completed); keys get an `eval_` prefix, and eval_perplexity
    follows eval_loss."""
    record: dict[str, Any] = {"step": int(step)}
    for key, value in scalars.items():
      record[key if key.startswith("eval_") else f"eval_{key}"] = float(value)
    if "eval_loss" in record and self.perplexity:
      record["eval_perplexity"] = perplexity(record["eval_loss"])
    record["elapsed_s"] = time.perf_counter() - self._start_time
    self._last_eval = {k: v for k, v in record.items() if k.startswith("eval_")}
    self._emit(record)

  def log_checkpoint(self, step: int, path: str) -> None:
    """Note a checkpoint saved after `step` steps at `path` (its params: load_parameters_path=`path`)."""
    self._last_checkpoint = path
    if self.is_writer:
      self._progress.write(f"step {step}/{self.config.steps} | checkpoint saved: {path}")

  def _train_record(
    self, step: int, step_time_s: float, values: Mapping[str, float], compiling: bool
  ) -> dict[str, Any]:
    record: dict[str, Any] = {"step": int(step), **values}
    if "loss" in record and self.perplexity:
      record["perplexity"] = perplexity(record["loss"])
    if not compiling:
      self._raise_measured_peak(step_time_s)
    record.update(self._throughput(step_time_s))
    if compiling:  # the time is mostly compilation: a FLOP rate from it would be meaningless
      record["tflops_per_s_per_device"] = record["mfu"] = None
    mean_step = self._mean_step_time()  # compile-step times would inflate the ETA many times over
    record["eta_s"] = None if mean_step is None else max(0, self.config.steps - step) * mean_step
    record["elapsed_s"] = time.perf_counter() - self._start_time
    record["compiling"] = compiling
    if self._goodput_figures is not None:
      record.update(self._goodput_figures())
    self._last_record = record
    return record

  def _raise_measured_peak(self, step_time_s: float | None) -> None:
    """A measured peak is what the host managed once, possibly while busy: when the model beats it, the
    achieved rate is the better estimate of the peak, so MFU stays <= 100%."""
    if not (self.peak_is_measured and step_time_s):
      return
    achieved = self.flops_per_step / step_time_s / self.num_devices
    if achieved > self.peak_flops_per_device:
      if self.is_writer:
        self._progress.write(
          f"note: {achieved / 1e12:.3g} TFLOP/s/device beats the measured peak of "
          f"{self.peak_flops_per_device / 1e12:.3g} (measured while the host was busier); MFU is now relative to it"
        )
      self.peak_flops_per_device = achieved

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
    self._progress.write(format_record(record, self.config.steps))
    self._file.write(json.dumps({k: _json_safe(v) for k, v in record.items()}, allow_nan=False) + "\n")
    self._file.flush()
    tb = self._tensorboard()
    if tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
          tb.add_scalar(_tb_tag(key), value, record["step"])
      tb.flush()
      if self._tb_mirror is not None:
        self._tb_mirror.sync()

  def summary(self) -> dict[str, Any]:
    """Run totals; timing means exclude the compile steps (None when no step was timed). final_loss is
    the last record's (a window mean); total_time_s the wall time since `started`."""
    mean_step = self._mean_step_time()
    rates = self._throughput(mean_step)
    return {
      "steps_run": self._steps_run,
      "final_loss": self._last_record.get("loss", self._last.get("loss")),
      "mean_step_time_s": mean_step,
      "tokens_per_s_per_device": rates["tokens_per_s_per_device"],
      "tflops_per_s_per_device": rates["tflops_per_s_per_device"],
      "mfu": rates["mfu"],
      "peak_tflops_per_s_per_device": self.peak_flops_per_device / 1e12,
      "compile_steps_time_s": self._compile_time_s,
      "total_time_s": time.perf_counter() - self._start_time,
      "last_checkpoint": self._last_checkpoint,
      "skipped_steps": self._skipped,
      **self._last_eval,
      **(self._goodput_figures() if self._goodput_figures is not None else {}),
      **({"sample_prompt": self.sample_prompt} if self.sample_prompt else {}),
    }

  def close(self) -> dict[str, Any]:
    """Flush and close the writers, print the summary (writer only) and return it. Idempotent."""
    result = self.summary()
    if self._closed:
      return result
    self._closed = True
    jax.monitoring.unregister_event_duration_listener(self._on_event)
    self._progress.close()
    if self.is_writer:
      print(format_summary(result, self.config), flush=True)
      self._file.close()
      if self._tb is not None:
        self._tb.close()
      if self._tb_mirror is not None:
        self._tb_mirror.close()
    return result


def _tb_tag(key: str) -> str:
  """TensorBoard groups: perf/*, eval/*, train/*."""
  if key.startswith("eval_"):
    return f"eval/{key[len('eval_') :]}"
  if key.startswith(("goodput", "badput_")):
    return f"goodput/{key}"
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
    parts.append("MFU n/a" if mfu_value is None else f"MFU {100 * mfu_value:.1f}%")
  if "eta_s" in r:
    eta = r.pop("eta_s")
    parts.append(f"ETA {'n/a' if eta is None else format_duration(eta)}")
  r.pop("elapsed_s", None)
  r = {k: v for k, v in r.items() if not k.startswith(("goodput", "badput_"))}  # the summary shows them
  compiling = r.pop("compiling", False)
  parts += [f"{k} {_num(v, '.4g')}" for k, v in r.items() if isinstance(v, (int, float))]
  return " | ".join(parts) + (" (compiling)" if compiling else "")


def format_summary(summary: Mapping[str, Any], config: Config | None = None) -> str:
  """The closing block: totals, then (with `config`) where the outputs are and the commands that read them."""
  mfu_value, peak = summary["mfu"], summary.get("peak_tflops_per_s_per_device")
  mfu_text = "n/a" if mfu_value is None else f"{100 * mfu_value:.2f}%"
  if peak is not None:
    mfu_text += f" of a {peak:.4g} TFLOP/s/device peak"
  lines = [
    "Training summary (timing excludes the compile steps)",
    f"  steps run            {summary['steps_run']}",
    f"  final loss           {_num(summary['final_loss'], '.4f')} (mean over the last log period)",
    f"  mean step time       {_num(summary['mean_step_time_s'], '.4g')} s",
    f"  tokens/s/device      {_num(summary['tokens_per_s_per_device'], ',.0f')}",
    f"  TFLOP/s/device       {_num(summary['tflops_per_s_per_device'], '.4g')}",
    f"  MFU                  {mfu_text}",
    f"  compile steps time   {format_duration(summary['compile_steps_time_s'])}",
    f"  total time           {format_duration(summary['total_time_s'])} (wall time of the whole run)",
  ]
  if "eval_loss" in summary:
    lines.append(f"  final eval loss      {_num(summary['eval_loss'], '.4f')}")
  if "goodput" in summary:
    lines += goodput.summary_lines(summary)
  if config is not None:
    lines += console.outputs_lines(config, summary.get("last_checkpoint"), summary.get("sample_prompt"))
  if summary.get("skipped_steps"):
    skipped, mostly = summary["skipped_steps"], ""
    if 2 * skipped > summary["steps_run"]:  # nonfinite.check_skipped makes such a run exit 1
      mostly = "; more than half of the steps run: the run exits 1"
    lines.append(f"  skipped steps        {skipped} (not applied: non-finite or a loss spike{mostly})")
  return "\n".join(lines)
