"""Goodput: the share of a run's wall time that was productive training, and where the rest went (badput).

Every second from the program's start (program_start) to exit is charged to exactly one kind, by one clock:
`charge(kind)` gives the time since the previous charge to `kind`, except the part that JAX spent tracing,
lowering and compiling on this thread meanwhile (jax.monitoring's compile events), which goes to `compile`.
The train loop charges at its existing phase boundaries (time.perf_counter() only: no device syncs of its own):

  startup             program start to the first step, less restore, compilation and the first batch
  compile             tracing + lowering + XLA compilation on the main thread (train step, eval step, init)
  productive          step time of steps never run before: dispatch + waiting for the device (below)
  data_wait           time the host is blocked in next() on the input pipeline
  checkpoint_save     time the loop blocks on saves (async saves only block for the copy to host memory,
                      and when they lag behind; the final wait at exit)
  checkpoint_restore  restoring this run's checkpoint, or load_parameters_path / load_full_state_path
  eval                the eval loop (its compile excluded)
  redone              step time of steps that an earlier attempt of this run had already run (it stopped
                      past the checkpoint this attempt resumed from: that work was lost)

The loop dispatches step N+1 before it waits for step N, so "step time" is the host's view: the time the host
spends dispatching steps and waiting for their results. data_wait overlaps the device running the step
already dispatched, so it is an upper bound on how long the device starved for data (near 0 with a fast
input pipeline). Time not inside any of these (the last few host operations before exit) is `other`.

The figures accumulate over the attempts of a run in <run dir>/goodput.json, rewritten atomically at every
log record and at exit (so a kill -9 loses at most the time since the last record). It also holds the
highest step any attempt reached, which is how a resumed attempt knows which steps are redone. Each
checkpoint keeps a copy of the record as it was when saved (its orbax step metadata, "goodput"): a damaged
goodput.json is said in one line and the history continues from the newest checkpoint's copy (else it
starts again); a directory in its place stops the run at start in one line.

Why not ml-goodput-measurement (upstream MaxText's recorder): in its 0.2.3 source, GoodputRecorder writes every
event to Cloud Logging through google.cloud.logging.Client() and GoodputCalculator reads them back from there;
with logging_enabled=False it records nothing, and the client needs Google Cloud credentials. There is no local
or file mode (the only other path is a private `cloud_logger` test hook), and it pulls in
google-cloud-logging, google-cloud-monitoring and scipy. This module keeps upstream's categories' meaning
(program startup, compile, data loading, checkpoint save/restore, wasted progress from disruption) offline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from MaxText import paths
from MaxText.config import Config
from MaxText.console import format_duration
from MaxText.errors import ConfigError

log = logging.getLogger(__name__)

RECORD_FILE = "goodput.json"  # in the run directory
METADATA_KEY = "goodput"  # the record's copy in each checkpoint's step metadata (custom_metadata)
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax's per-step metadata (JSON) in <checkpoints>/<step>/
VERSION = 1
KINDS = (
  "startup",
  "compile",
  "productive",
  "data_wait",
  "checkpoint_save",
  "checkpoint_restore",
  "eval",
  "redone",
)
BADPUT = tuple(k for k in KINDS if k != "productive") + ("other",)
# jax.monitoring events (jax._src.dispatch) whose durations are compilation: sequential, never nested.
COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)
LABELS = {"data_wait": "data wait", "checkpoint_save": "checkpoint save", "checkpoint_restore": "restore"}


class _CompileTime:
  """Seconds of compilation on the main thread so far: one jax.monitoring listener for the process, added by
  the first Recorder (recorders take differences, so none needs to remove it)."""

  def __init__(self) -> None:
    self.total_s = 0.0
    self.listening = False

  def listen(self) -> None:
    if not self.listening:
      jax.monitoring.register_event_duration_secs_listener(self._on_event)
      self.listening = True

  def _on_event(self, event: str, duration_s: float, **_: Any) -> None:
    # Compiles on other threads (a background save) do not hold up the loop.
    if event in COMPILE_EVENTS and threading.current_thread() is threading.main_thread():
      self.total_s += duration_s


COMPILE_TIME = _CompileTime()


def program_start() -> float:
  """time.perf_counter() when this program started: MaxText's first import (MaxText.IMPORTED_AT), which precedes
  jax's, so start-up includes the imports. Only the interpreter's own start (some tens of ms) comes before it; what
  ran earlier in the same process (a shell that execs python after pip) is not this program's time."""
  import MaxText  # noqa: PLC0415

  return MaxText.IMPORTED_AT


def empty_record() -> dict[str, Any]:
  return {
    "version": VERSION,
    "attempts": 0,
    "total_s": 0.0,
    "seconds": dict.fromkeys(KINDS, 0.0),
    "steps": {"productive": 0, "redone": 0},
    "max_step": 0,
  }


def _load(path: str) -> tuple[dict[str, Any], str]:
  """(the record saved at `path` ({} when there is none), what is wrong with it ("" when nothing))."""
  if not path or not paths.isfile(path):
    return {}, ""
  try:
    saved = json.loads(paths.Path(path).read_text())
  except (OSError, ValueError) as e:
    return {}, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  if not isinstance(saved, dict) or saved.get("version") != VERSION:
    return {}, f"it is not a version {VERSION} goodput record"
  return saved, ""


def checkpoint_copy(checkpoint_dir: str) -> tuple[dict[str, Any], int]:
  """(the record kept by the newest checkpoint under `checkpoint_dir` that has a whole one, its step); ({}, 0)
  when none has (a fresh run, checkpoints written before copies were kept)."""
  steps = sorted((int(p) for p in paths.listdir(checkpoint_dir) if p.isdigit()), reverse=True) if checkpoint_dir else []
  for step in steps:
    try:
      meta = json.loads(paths.Path(paths.join(checkpoint_dir, str(step), STEP_METADATA_FILE)).read_text())
      saved = (meta.get("custom_metadata") or {}).get(METADATA_KEY)
    except (OSError, ValueError, AttributeError):
      continue
    if isinstance(saved, dict) and saved.get("version") == VERSION:
      return saved, step
  return {}, 0


def read_record(path: str, checkpoint_dir: str = "") -> dict[str, Any]:
  """The record an earlier attempt left at `path`; an empty one if there is none. A damaged one is said in one
  line and replaced by the newest checkpoint's copy (checkpoint_copy) when there is one, else the figures start
  again (goodput never stops a run); a directory at `path` is a ConfigError."""
  if paths.is_local_dir(path):
    raise ConfigError(f"{path!r} is a directory where the run's goodput record (a file) goes; remove it")
  saved, damage = _load(path)
  if damage:
    saved, step = checkpoint_copy(checkpoint_dir)
    kept = f"the history continues from checkpoint {step}'s copy" if saved else "the goodput figures start again"
    log.warning("%s is damaged (%s); %s", path, damage, kept)
  record = empty_record()
  if not saved:
    return record
  record.update({k: saved[k] for k in ("attempts", "total_s", "max_step") if k in saved})
  record["seconds"].update({k: float(v) for k, v in saved.get("seconds", {}).items() if k in KINDS})
  record["steps"].update({k: int(v) for k, v in saved.get("steps", {}).items() if k in record["steps"]})
  return record


class Recorder:
  """One attempt's clock, added to the earlier attempts' record. `origin`: perf_counter() when this process
  started (program_start()); `is_writer`: this process writes the record. Disabled (enable_goodput_recording
  false, or Recorder.off()): every method is a no-op and figures() is empty."""

  def __init__(self, config: Config | None, origin: float, is_writer: bool, enabled: bool = True):
    self.enabled = enabled and config is not None and config.enable_goodput_recording
    self.is_writer = is_writer
    self.path = paths.join(config.run_dir, RECORD_FILE) if config is not None else ""
    checkpoints = config.checkpoint_dir if config is not None and config.enable_checkpointing else ""
    self.prior = read_record(self.path, checkpoints) if self.enabled else empty_record()
    self.prior_max = int(self.prior["max_step"])
    self.seconds = dict.fromkeys(KINDS, 0.0)
    self.steps = {"productive": 0, "redone": 0}
    self.max_step, self.counted = self.prior_max, -1
    self.current = "startup"  # what the open segment is charged to when a phase begins
    self.origin = self.mark = origin
    if self.enabled:
      COMPILE_TIME.listen()
    self._compiled_s = COMPILE_TIME.total_s  # what the earlier charges took (compiles before now: none of ours)

  @classmethod
  def off(cls) -> Recorder:
    return cls(None, time.perf_counter(), is_writer=False, enabled=False)

  def charge(self, kind: str | None = None) -> None:
    """The time since the last charge goes to `kind` (default: the current one), its compilation to compile."""
    if not self.enabled:
      return
    now = time.perf_counter()
    elapsed, self.mark = now - self.mark, now
    compiling = min(COMPILE_TIME.total_s - self._compiled_s, elapsed)
    self._compiled_s = COMPILE_TIME.total_s
    self.seconds["compile"] += compiling
    self.seconds[kind or self.current] += elapsed - compiling

  def restored(self, source: str) -> None:
    """restore_or_init just returned a state from `source` (checkpointing.Restored.source)."""
    self.charge("startup" if source == "init" else "checkpoint_restore")

  def step(self, done: int) -> None:
    """The loop has dispatched step `done` (steps completed once it finishes) and read the one before: the
    time since the last charge is step time, productive unless an earlier attempt reached `done` already."""
    if not self.enabled:
      return
    self.current = "redone" if done <= self.prior_max else "productive"
    self.charge()
    if done > self.counted:
      self.counted = done
      self.steps[self.current] += 1
      self.max_step = max(self.max_step, done)

  @contextlib.contextmanager
  def phase(self, kind: str) -> Iterator[None]:
    """Charge the open segment to the current kind, then the block's time to `kind`."""
    self.charge()
    try:
      yield
    finally:
      self.charge(kind)

  def record(self) -> dict[str, Any]:
    """The run's record so far: earlier attempts plus this one."""
    total = self.prior["total_s"] + time.perf_counter() - self.origin
    return {
      "version": VERSION,
      "attempts": self.prior["attempts"] + 1,
      "total_s": total,
      "seconds": {k: self.prior["seconds"][k] + self.seconds[k] for k in KINDS},
      "steps": {k: self.prior["steps"][k] + self.steps[k] for k in self.steps},
      "max_step": self.max_step,
    }

  def write(self) -> dict[str, Any]:
    """Persist the record (writer process; atomically) and return it."""
    record = self.record()
    if self.enabled and self.is_writer:
      paths.makedirs(paths.dirname(self.path))
      paths.write_atomic(self.path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record

  def checkpoint_metadata(self) -> dict[str, Any]:
    """What a checkpoint saved now keeps of the record (its step metadata): the run's record so far."""
    return {METADATA_KEY: self.record()} if self.enabled else {}

  def figures(self) -> dict[str, Any]:
    """Flat fields for a metrics record and the summary (fractions of the total wall time); charges the open
    segment (the logger calls this while reading a step: step time) and writes the record. Empty when disabled."""
    if not self.enabled:
      return {}
    self.charge()
    return fractions(self.write())

  def close(self) -> dict[str, Any]:
    """At exit: write the record and stop recording. The time since the last charge (the last host work
    before exit) stays uncharged: badput_other."""
    if not self.enabled:
      return {}
    record = self.write()
    self.stop()
    return record

  def stop(self) -> None:
    """Stop recording without writing (an attempt that trains nothing adds nothing to the run's record)."""
    self.enabled = False


def fractions(record: dict[str, Any]) -> dict[str, Any]:
  """goodput and badput_<kind> as fractions of total_s (badput_other: the time charged to no kind), with the
  total, the redone steps and the attempts."""
  total = max(record["total_s"], 1e-9)
  seconds = record["seconds"]
  out: dict[str, Any] = {"goodput": seconds["productive"] / total}
  out.update({f"badput_{k}": seconds[k] / total for k in KINDS if k != "productive"})
  out["badput_other"] = max(0.0, 1.0 - sum(seconds.values()) / total)
  out.update(
    goodput_total_s=record["total_s"],
    goodput_redone_steps=record["steps"]["redone"],
    goodput_attempts=record["attempts"],
  )
  return out


def summary_lines(fields: dict[str, Any]) -> list[str]:
  """Two lines of the closing summary: the goodput, then the badput kinds that took at least 0.1%."""
  attempts = fields["goodput_attempts"]
  over = f" over {attempts} attempts" if attempts > 1 else ""
  head = f"  goodput              {100 * fields['goodput']:.1f}% of {format_duration(fields['goodput_total_s'])}{over}"
  parts = []
  for kind in sorted(BADPUT, key=lambda k: -fields[f"badput_{k}"]):
    share = fields[f"badput_{kind}"]
    if share >= 0.001:
      label = LABELS.get(kind, kind)
      if kind == "redone":
        label = f"redone steps ({fields['goodput_redone_steps']})"
      parts.append(f"{label} {100 * share:.1f}%")
  return [head, f"  badput               {', '.join(parts) or 'none'} (goodput.json in the run directory)"]
