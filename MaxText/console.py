"""What a training run prints besides its metric records: the start-up header, the live progress line
between records, and where the outputs went at the end (docs/outputs.md shows each)."""

from __future__ import annotations

import math
import os
import shlex
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from MaxText import paths
from MaxText.config import Config

PROGRESS_INTERVAL_S = 60.0  # without a terminal: a plain progress line when nothing was printed for this long
HEARTBEAT_S = 60.0  # a long compile says it is still running this often


def format_duration(seconds: float) -> str:
  """45s, 1m14s, 2h03m."""
  s = max(0, int(round(seconds)))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _count(n: float) -> str:
  """1.2M, 345K, 7.0B."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{int(n)}"


def _data_line(config: Config) -> str:
  if config.dataset_type == "synthetic":
    return "synthetic (uniform random tokens)"
  source = config.dataset_path or ("Python stdlib sources" if config.dataset_type == "text" else "")
  if config.dataset_type in ("tfds", "hf") and getattr(config, "dataset_name", ""):
    source = f"{config.dataset_name} {source}".strip()
  tokenizer = config.tokenizer_path or f"trained on the corpus, cached in {config.tokenizer_dir}"
  return f"{config.dataset_type}: {source} | tokenizer {tokenizer}"


def run_header(
  config: Config,
  *,
  num_params: int,
  mesh_shape: Mapping[str, int],
  global_batch: int,
  start: int,
  source: str,
  peak: str,
  platform: str,
  num_trainable: int | None = None,
  plan: Sequence[str] = (),
) -> str:
  """The few lines a run prints before its first step (the whole config is in <run dir>/config.yml;
  log_config=true prints it too). `source` is where the state came from, `peak` Peak.describe(), `platform`
  the devices' platform (cpu, gpu, tpu); `num_trainable`, under LoRA, the adapters' parameter count; `plan`
  the run plan's lines (planner.describe)."""
  axes = {k: v for k, v in mesh_shape.items() if v > 1} or {"data": 1}
  devices = math.prod(mesh_shape.values())
  plural = "device" if devices == 1 else "devices"
  outputs = paths.absolute(config.run_dir)
  base_note = (
    " (the default; set base_output_directory=... to move it)" if config.base_output_directory == "outputs" else ""
  )
  trainable = "" if num_trainable is None else f" (trainable {_count(num_trainable)}, LoRA)"
  lines = [
    f"run {config.run_name}: steps {start} -> {config.steps} | start: {source}",
    f"  model    {config.model_name} ({config.decoder_block}), {_count(num_params)} parameters{trainable}, "
    f"{config.num_decoder_layers} layers x {config.emb_dim} wide, vocab {config.vocab_size}, {config.dtype}",
    f"  batch    {global_batch} x {config.max_target_length} tokens per step (global), learning_rate "
    f"{config.learning_rate:g} over {config.learning_rate_schedule_steps_resolved} schedule steps",
    f"  mesh     {' x '.join(f'{k} {v}' for k, v in axes.items())} ({devices} {platform} {plural}) | {peak}",
    f"  data     {_data_line(config)}",
    f"  outputs  {outputs}/ (config.yml, metrics.jsonl{', tensorboard/' if config.enable_tensorboard else ''}"
    f"{', checkpoints/' if config.enable_checkpointing else ''}){base_note}",
  ]
  lines += [f"  {'plan' if i == 0 else ''.ljust(4)}     {line}" for i, line in enumerate(plan)]
  return "\n".join(lines)


def outputs_lines(config: Config, last_checkpoint: str | None, prompt: str | None = None) -> list[str]:
  """The closing summary's pointers to what the run wrote, with the commands that read them (`prompt`: the
  decode command's, e.g. the first words of a held-out document)."""
  lines = [f"  run directory        {paths.absolute(config.run_dir)}"]
  if last_checkpoint:
    lines.append(f"  last checkpoint      {last_checkpoint}")
    lines.append(f"    generate:          {decode_command(config, last_checkpoint, prompt)}")
  lines.append(f"  metrics              {paths.absolute(config.metrics_file)}")
  lines.append(f"    plot:              python3 -m MaxText.plot_metrics {paths.absolute(config.metrics_file)}")
  if config.enable_tensorboard:
    lines.append(f"    TensorBoard:       tensorboard --logdir {paths.absolute(config.tensorboard_dir)}")
  return lines


def decode_command(config: Config, checkpoint: str, prompt: str | None = None) -> str:
  """The decode.py command line for `checkpoint` of this run: the run's own config.yml (its model, tokenizer and
  run directory) with the checkpoint's params, or under LoRA its adapters over the run's base. It samples
  (nucleus): a small model decoded greedily mostly repeats one word. `prompt` (default: the config's) is best
  taken from the run's own data, which is all the model knows."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py")
  relative = os.path.relpath(script)  # MaxText/decode.py from the repository root
  args = [
    "python3",
    script if relative.startswith("..") else relative,
    paths.join(paths.absolute(config.run_dir), "config.yml"),
  ]
  if config.lora_rank > 0:
    args.append(f"lora_weights_path={checkpoint}")
  else:
    args.append(f"load_parameters_path={checkpoint}")
    if config.load_full_state_path:  # how this run started; decode.py takes one of the two
      args.append("load_full_state_path=")
  if prompt:
    args.append(f"prompt={prompt}")
  if config.decode_sampling_strategy == "greedy":
    args.append("decode_sampling_strategy=nucleus")
  return shlex.join(args)


class Progress:
  """A live line between metric records. On a terminal (stderr is a tty): a tqdm bar with the rate and
  ETA, records printed above it. Otherwise (logs, pipes): no bar, but a plain `progress: step N/M`
  line to stdout when nothing was printed for PROGRESS_INTERVAL_S, so a long log_period still shows
  the run is alive without filling log files."""

  def __init__(
    self, total: int, initial: int, enabled: bool, stream: TextIO | None = None, interval_s: float = PROGRESS_INTERVAL_S
  ):
    stream = sys.stderr if stream is None else stream
    self.enabled, self.total, self.interval_s = enabled, total, interval_s
    self.bar = None
    self.last_output = time.perf_counter()
    if enabled and _isatty(stream):
      from tqdm import tqdm  # lazy: only for interactive runs

      self.bar = tqdm(total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True, leave=False)

  def write(self, line: str) -> None:
    """Print a line to stdout (above the bar, if any); printed whether or not progress is enabled."""
    if self.bar is not None:
      self.bar.clear()
    print(line, flush=True)
    if self.bar is not None:
      self.bar.refresh()
    self.last_output = time.perf_counter()

  def update(self, step: int, loss: float | None, eta_s: float | None) -> None:
    """Step `step` (steps completed) is done."""
    if not self.enabled:
      return
    if self.bar is not None:
      if loss is not None:
        self.bar.set_postfix_str(f"loss {loss:.4g}", refresh=False)
      self.bar.update(step - self.bar.n)  # redraws at most every tqdm mininterval (0.1 s), not every step
    elif time.perf_counter() - self.last_output >= self.interval_s and step < self.total:
      eta = "n/a" if eta_s is None else format_duration(eta_s)
      self.write(f"progress: step {step}/{self.total} | ETA {eta}")

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None


def _isatty(stream: Any) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):  # a closed or fake stream
    return False


class Heartbeat:
  """A context manager for long work that prints nothing of its own (an XLA compile): every `interval_s` a line
  on `stream` says it is still running and for how long. A thread waits on an event, so a short compile costs
  nothing and a finished one prints no more. XLA itself may print a "Very slow compile?" banner meanwhile: the
  first heartbeat says it is a notice for XLA bug reports, not an error."""

  def __init__(self, what: str, enabled: bool = True, interval_s: float = HEARTBEAT_S, stream: TextIO | None = None):
    self.what, self.enabled, self.interval_s = what, enabled, interval_s
    self.stream = sys.stdout if stream is None else stream
    self._done: threading.Event | None = None  # made on entry when enabled: a disabled one (each later step) is free
    self._thread: threading.Thread | None = None

  def __enter__(self) -> Heartbeat:
    if self.enabled:
      self._done = threading.Event()
      self._thread = threading.Thread(target=self._beat, args=(time.perf_counter(),), daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc: object) -> None:
    if self._thread is not None:
      self._done.set()
      self._thread.join()

  def _beat(self, began: float) -> None:
    beats = 0
    while not self._done.wait(self.interval_s):
      beats += 1
      note = ' (XLA\'s "Very slow compile?" banner, if it comes, is a notice, not an error)' if beats == 1 else ""
      self.stream.write(f"{self.what}: still running, {format_duration(time.perf_counter() - began)} so far{note}\n")
      self.stream.flush()
