"""Train a decoder-only LM: config -> mesh -> state -> loop (metrics, eval, checkpoints), the one trainer of
every objective (objective=lm | dpo | grpo: MaxText/objectives/).

python3 MaxText/train.py MaxText/configs/base.yml run_name=NAME key=value ...
"""

from __future__ import annotations

try:  # first: a signal during the imports below exits in one line (preemption.py)
  import MaxText  # noqa: F401
except ModuleNotFoundError as e:  # run as a file with the requirements alone: say what installs the package
  raise SystemExit(f"{e}: run `bash setup.sh` (or `pip install -e .` in this environment) first") from None

# isort: split
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import yaml
from jax.sharding import Mesh

from MaxText import (
  accelerators,
  checkpointing,
  compiled_step,
  console,
  elastic,
  flops,
  goodput,
  hlo_dump,
  launch,
  memory_fit,
  metrics,
  nonfinite,
  objectives,
  optimizers,
  paths,
  planner,
  preemption,
  saved_config,
  sharding,
)
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.config import Config
from MaxText.errors import CheckpointError, ConfigError
from MaxText.nonfinite import NonFiniteLossError, SkippedUpdatesError
from MaxText.objectives import rewards
from MaxText.objectives.base import Sources


def check_hardware(config: Config) -> None:
  backend = jax.default_backend()
  if config.hardware != "auto" and backend != config.hardware:
    raise ConfigError(f"hardware={config.hardware} but JAX found {backend} devices; set hardware=auto or {backend}")


# The output locations config.yml records as absolute paths (local ones), so that the file given back as the
# config (train.py, decode.py, train_compile.py) points at this run from any working directory.
LOCATION_KEYS = (
  "base_output_directory",
  "run_dir",
  "checkpoint_dir",
  "tensorboard_dir",
  "tokenizer_dir",
  "metrics_file",
)


def write_config(config: Config) -> None:
  """Record the resolved config next to the run's outputs (writer process only); usable as the config of a
  later command (config.load recomputes the derived keys it holds)."""
  if jax.process_index() != 0:
    return
  paths.makedirs(config.run_dir)
  values = {**config.to_dict(), **{key: paths.absolute(config[key]) for key in LOCATION_KEYS}}
  paths.Path(paths.join(config.run_dir, "config.yml")).write_text(yaml.safe_dump(values, sort_keys=True))


def evaluate(config: Config, eval_fn: Any, params: Any, eval_factory: Any, reference: Any = None) -> dict[str, float]:
  """eval_steps batches of the eval split (-1: one epoch, padding rows not counted): the objective's eval metrics
  of the sums added over them (lm: the token-weighted mean loss; dpo: the mean loss per pair and the dpo_*
  metrics of the held-out pairs, against `reference`)."""
  objective = objectives.get(config)
  totals: dict[str, float] = {}
  for done, batch in enumerate(eval_factory(), 1):  # with eval_steps=-1 the iterator ends after one epoch
    sums = jax.device_get(eval_fn(params, batch, reference) if objective.reference else eval_fn(params, batch))
    totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
    if done == config.eval_steps:
      break
  return objective.eval_metrics(config, totals)


class Profiler:
  """An xplane trace of profiler_steps steps after skip_first_n_steps_for_profiler: started before the
  first one is dispatched, stopped once the host has seen the last one complete (dispatch is
  asynchronous, so stopping right after dispatching it would cut its device work off)."""

  def __init__(self, config: Config, start: int):
    self.enabled = config.profiler
    self.first = start + config.skip_first_n_steps_for_profiler
    self.last = self.first + config.profiler_steps - 1
    self.logdir = config.tensorboard_dir

  def dispatching(self, step: int) -> None:
    if self.enabled and step == self.first:
      jax.profiler.start_trace(self.logdir)

  def finished(self, step: int) -> None:
    if self.enabled and step == self.last:
      jax.profiler.stop_trace()


@contextlib.contextmanager
def stack_traces(config: Config):
  """Periodic Python stack traces (for hangs) through cloud-tpu-diagnostics, when enabled."""
  if not config.collect_stack_trace:
    yield
    return
  from cloud_tpu_diagnostics import diagnostic
  from cloud_tpu_diagnostics.configuration import (
    debug_configuration,
    diagnostic_configuration,
    stack_trace_configuration,
  )

  trace = stack_trace_configuration.StackTraceConfig(
    collect_stack_trace=True,
    stack_trace_to_cloud=config.stack_trace_to_cloud,
    stack_trace_interval_seconds=config.stack_trace_interval_seconds,
  )
  debug = debug_configuration.DebugConfig(stack_trace_config=trace)
  with diagnostic.diagnose(diagnostic_configuration.DiagnosticConfig(debug_config=debug)):
    yield


@dataclasses.dataclass(frozen=True)
class LoopParts:
  """Everything train_loop needs, built once by run()."""

  mesh: Mesh
  spec: state_lib.StateSpec
  restored: checkpointing.Restored  # the starting state and where it came from
  data: Sources  # the objective's train batches (data or rollouts) and eval iterators
  manager: Any  # orbax CheckpointManager, or None without checkpointing
  step_fn: Any  # jitted (state, batch, rng) -> (state, metrics)
  global_batch: int  # sequences per step
  peak: accelerators.Peak  # per-device peak FLOP/s (for MFU) and where it comes from
  started: float  # perf_counter() when the run began: the origin of elapsed_s and the total time
  watch: preemption.Watch | None = None  # signals: stop (with a checkpoint) at an agreed step boundary
  goodput: goodput.Recorder = dataclasses.field(default_factory=goodput.Recorder.off)  # where the time went


def run(
  config: Config,
  devices: Sequence[Any] | None = None,
  started: float | None = None,
  process_started: float | None = None,
) -> dict[str, Any]:
  """Train to config.steps on `devices` (default: all); returns the metrics summary. `started`:
  perf_counter() when the process began its work (main passes it, so the summary's total time includes
  config loading); default now. `process_started`: the origin of the goodput clock (main passes
  goodput.program_start()); default `started`. A run already at config.steps trains nothing and returns
  {"steps_run": 0}."""
  started = time.perf_counter() if started is None else started
  clock = goodput.Recorder(config, started if process_started is None else process_started, jax.process_index() == 0)
  check_hardware(config)
  config = keep_schedule_on_resume(config)
  mesh = sharding.create_mesh(config, devices)
  config = elastic.resume_config(config, mesh)  # a resume (e.g. on other chips) keeps the global batch
  # A step compiled for other hardware or settings is refused before any state is built for it.
  compiled = compiled_step.read_checked(config, mesh) if config.compiled_trainstep_file else None
  global_batch = sharding.global_batch_size(config, mesh)  # fails early on a batch that cannot split
  objective = objectives.get(config)
  objective.check(config, global_batch)  # its settings, before anything is built or compiled
  plan = planner.build(config, mesh)  # every layout decision, and every layout error, before any compile
  optimizer = optimizers.build(config)
  peak = accelerators.peak(dtype=config.dtype)  # CPU: a measured matmul, outside the mesh
  with sharding.activate(config, mesh), stack_traces(config), preemption.Watch(mesh) as watch:
    spec = state_lib.state_spec(config, optimizer.tx, mesh, plan)
    memory_fit.announce(config, mesh, spec, global_batch, peak.flops)  # before anything is allocated
    data = objective.sources(config, mesh)
    manager = checkpointing.create_manager(config)
    clock.charge()
    restored = checkpointing.restore_or_init(config, optimizer.tx, spec, manager, data.train.set_state)
    clock.restored(restored.source)
    start = int(restored.state.step)
    if already_done(config, start):
      clock.stop()
      return {"steps_run": 0}
    write_config(config)
    try:
      step_fn = train_step_fn(config, mesh, optimizer, spec, compiled)
      parts = LoopParts(mesh, spec, restored, data, manager, step_fn, global_batch, peak, started, watch, clock)
      # A lost process exits here, before the `finally` below: its saves and barriers would wait for the dead
      # process, and the sooner the line is out the likelier it precedes JAX's own abort (docs/failures.md).
      with preemption.lost_processes(config.checkpoint_dir if config.enable_checkpointing else None):
        return train_loop(config, parts)
    except NonFiniteLossError as e:  # what to change, and where a rerun resumes (in-flight saves complete first)
      e.__traceback__ = None  # releases the failed step's state before a checkpoint is read again
      resumed = start if restored.source.startswith("resume") else None
      message = nonfinite.advice(config, manager, e, resumed, spec.partition.checkpointed(spec.abstract))
      raise NonFiniteLossError(message, e.step, e.loss_finite) from None
    finally:  # on success or error, let in-flight (async) checkpoints of good steps complete
      if manager is not None:
        with clock.phase("checkpoint_save"):
          checkpointing.finish(manager)
      hlo_dump.publish(config, jax.process_index() == 0)  # dump_hlo: the step's HLO into the run directory
      clock.close()  # goodput.json: this attempt's time added to the run's


def already_done(config: Config, start: int) -> bool:
  """Whether the restored state is already at (or past) config.steps; says so (writer) when it is."""
  if start < config.steps:
    return False
  if jax.process_index() == 0:
    print(f"already at steps={start}; pass steps=N with N > {start} to train further", flush=True)
  return True


def previous_config(config: Config) -> dict[str, Any] | None:
  """The config.yml of the run being resumed: present only if this run_name has a checkpoint to resume."""
  if not config.enable_checkpointing or not paths.isdir(config.checkpoint_dir):
    return None
  path = paths.join(config.run_dir, "config.yml")
  if not any(name.isdigit() for name in paths.listdir(config.checkpoint_dir)) or not paths.isfile(path):
    return None
  return yaml.safe_load(paths.Path(path).read_text())


def keep_schedule_on_resume(config: Config) -> Config:
  """A resume that changes steps keeps the learning-rate schedule it started with (see
  optimizers.resumed_schedule); prints a note when that applies."""
  config, note = optimizers.resumed_schedule(config, previous_config(config))
  if note and jax.process_index() == 0:
    print(f"note: {note}", flush=True)
  return config


def train_step_fn(
  config: Config, mesh: Mesh, optimizer: optimizers.Optimizer, spec: state_lib.StateSpec, compiled: Any = None
) -> Any:
  """The jitted train step, or the one train_compile.py saved (`compiled`: compiled_step.read_checked's)."""
  if compiled is not None:
    return compiled_step.load_compiled(compiled)
  return steps.jit_train_step(config, mesh, optimizer.tx, spec, optimizer.schedule)


class Pending(NamedTuple):
  """A dispatched step whose metrics the host has not read yet."""

  step: int
  metrics: dict[str, jax.Array]  # device scalars from the step function
  dispatch: tuple[float, float]  # perf_counter() before and after the step function call (compiles happen here)
  host: Any = None  # host metrics that came with the step's batch (Fetched.metrics: GRPO's rewards, ...)


class StepReader:
  """Reads each step's metrics one step late, so the host dispatches step N+1 before it waits for step N
  and the device never idles while the host logs, checks or fetches data.

  step_time_s of step N = wall time from the host seeing step N-1 complete (or the loop (re)starting:
  the run's start, the end of an eval or checkpoint pause) to the host seeing step N complete (its
  metrics read). In a steady state that is the time per step the run actually achieves: the slower of
  device compute and host work (data, dispatch, logging), the two overlapping. Eval and checkpoint time
  is not in any step's time.
  """

  def __init__(self, config: Config, logger: metrics.MetricLogger, profiler: Profiler):
    self.config, self.logger, self.profiler = config, logger, profiler
    self.pending: Pending | None = None
    self.mark = time.perf_counter()

  def restart_clock(self) -> None:
    """The next step's time starts now (after a pause that is not step time)."""
    self.mark = time.perf_counter()

  def push(self, pending: Pending) -> None:
    """Read and log the previous step (it is waited for here), then keep `pending` for later."""
    self.flush()
    self.pending = pending

  def flush(self) -> None:
    """Read, log and check the pending step, if any; raises NonFiniteLossError on a non-finite loss."""
    if self.pending is None:
      return
    done, self.pending = self.pending, None
    scalars = {k: float(v) for k, v in jax.device_get(done.metrics).items()} | dict(done.host or {})
    now = time.perf_counter()
    completed = done.step + 1  # logs, evals and checkpoints count steps completed
    self.logger.log(completed, scalars, now - self.mark, dispatch=done.dispatch)
    self.mark = now
    self.profiler.finished(done.step)
    nonfinite.check_finite(self.config, completed, scalars)


def make_logger(config: Config, parts: LoopParts, start: int, is_writer: bool) -> metrics.MetricLogger:
  tokens_per_step = parts.global_batch * config.max_target_length
  per_token = flops.training_flops_per_token(config, flops.abstract_model(config, parts.spec))
  return metrics.MetricLogger(
    config,
    num_devices=parts.mesh.size,
    tokens_per_step=tokens_per_step,
    flops_per_step=per_token.total * tokens_per_step,
    peak_flops_per_device=parts.peak.flops,
    start_step=start,
    is_writer=is_writer,
    peak_is_measured=parts.peak.measured,
    started=parts.started,
    progress=config.progress_bar,
    goodput_figures=parts.goodput.figures if parts.goodput.enabled else None,
    perplexity=objectives.get(config).perplexity,
    sample_prompt=parts.data.sample_prompt,
  )


def print_header(config: Config, parts: LoopParts, start: int) -> None:
  """The run's start-up lines (writer process only); the full config is in <run dir>/config.yml."""
  if jax.process_index() != 0:
    return
  header = console.run_header(
    config,
    num_params=parts.spec.num_params,
    num_trainable=parts.spec.num_trainable if parts.spec.partition.freezes else None,
    mesh_shape=dict(parts.mesh.shape),
    global_batch=parts.global_batch,
    start=start,
    source=parts.restored.source,
    peak=parts.peak.describe(),
    platform=parts.mesh.devices.flat[0].platform,
    plan=planner.describe(parts.spec.plan, config),
  )
  print("\n".join([header, *parts.data.train.describe()]), flush=True)


def checkpoint_path(config: Config, step: int) -> str:
  """The params of checkpoint `step`, as load_parameters_path and decode.py take them."""
  return paths.join(paths.absolute(config.checkpoint_dir), str(step), "state")


def train_loop(config: Config, parts: LoopParts) -> dict[str, Any]:
  """Steps from the restored state to config.steps: log, evaluate, checkpoint; the metrics summary.

  Asynchronous: step N+1 is dispatched before step N's metrics are read (StepReader), and batch N+1 is
  fetched while step N runs. Steps that evaluate or checkpoint, and the last step, are read at once, so
  a checkpoint only ever holds a state whose loss was checked, and the data iterator state saved with
  the checkpoint after step N is the one after exactly N batches (the next batch is fetched after it).
  A batch source that samples (GRPO) reads the params step N left, so its fetch waits for step N.
  """
  state, start = parts.restored.state, int(parts.restored.state.step)
  print_header(config, parts, start)
  eval_fn = None
  if parts.data.eval_factory and config.eval_interval > 0:
    eval_fn = steps.jit_eval_step(config, parts.mesh, parts.spec)
  dropout_key = jax.random.key(config.dropout_seed)
  profiler = Profiler(config, start)
  with make_logger(config, parts, start, jax.process_index() == 0) as logger:
    reader = StepReader(config, logger, profiler)
    fetched = fetch(parts, state, reader) if start < config.steps else None
    for step in range(start, config.steps):
      profiler.dispatching(step)
      t0 = time.perf_counter()
      with console.Heartbeat("compiling the train step", enabled=step == start and jax.process_index() == 0):
        state, step_metrics = parts.step_fn(state, fetched.batch, jax.random.fold_in(dropout_key, step))
      reader.push(Pending(step, step_metrics, (t0, time.perf_counter()), fetched.metrics))
      done = step + 1
      parts.goodput.step(done)
      if not at_boundary(config, parts, state, done, eval_fn, reader, logger):
        break
      if parts.manager is not None and done % config.checkpoint_period == config.async_checkpoint_max_lag_steps:
        with parts.goodput.phase("checkpoint_save"):
          checkpointing.wait_for_saves(parts.manager)  # bounds what a kill loses: docs/failures.md
      if done < config.steps:  # fetched while this step runs on the device
        fetched = fetch(parts, state, reader)
    reader.flush()
  return logger.summary()


def fetch(parts: LoopParts, state: Any, reader: StepReader) -> Any:
  """The next step's batch (objectives.base.Fetched), as goodput's data_wait. On an error (data, a reward),
  the step already run is logged first."""
  with parts.goodput.phase("data_wait"):
    try:
      return parts.data.train.next(state)
    except Exception:
      reader.flush()
      raise


def at_boundary(config, parts: LoopParts, state, done: int, eval_fn, reader: StepReader, logger) -> bool:
  """After step `done`: evaluate, checkpoint, stop on a signal (raises preemption.Stopped) as due; False when
  target_eval_loss is reached (the loop stops there)."""
  stop = parts.watch.stop_signal() if parts.watch else 0  # the same on every process
  manager, clock = parts.manager, parts.goodput
  evaluating = eval_fn is not None and (done % config.eval_interval == 0 or done == config.steps) and not stop
  saving = manager is not None and (done % config.checkpoint_period == 0 or done == config.steps or stop)
  if not (evaluating or saving or done == config.steps or stop):
    return True
  reader.flush()  # this step's loss is checked before anything of it is saved
  reached = False  # target_eval_loss reached: checkpoint and stop early
  if evaluating:
    with clock.phase("eval"):
      result = evaluate(config, eval_fn, state.params, parts.data.eval_factory, state.reference)
    logger.log_eval(done, result)
    reached = 0 < config.target_eval_loss and result["eval_loss"] <= config.target_eval_loss
  if manager is not None and (saving or reached):
    saved = parts.spec.partition.checkpointed(state)  # LoRA: the adapters
    with clock.phase("checkpoint_save"):
      metadata = elastic.layout(config, parts.mesh) | clock.checkpoint_metadata()  # goodput.py: its copy
      checkpointing.save(manager, done, saved, parts.data.train.get_state(), metadata)
    logger.log_checkpoint(done, checkpoint_path(config, done))
  if reached:
    if jax.process_index() == 0:
      print(f"eval_loss {result['eval_loss']:.4f} <= target_eval_loss: stopping at step {done}", flush=True)
    return False
  if stop and done < config.steps:  # run() waits for the save before the exception leaves it
    path = paths.join(config.checkpoint_dir, str(done)) if manager is not None else None
    raise preemption.Stopped(done, parts.watch.signum or stop, path, here=bool(parts.watch.signum))
  reader.restart_clock()
  return True


USAGE = launch.Usage(
  command="python3 MaxText/train.py MaxText/configs/base.yml run_name=NAME [key=value ...]",
  summary="Train a decoder-only LM: config -> mesh -> state -> loop (metrics, eval, checkpoints).",
  keys=(
    "run_name", "base_output_directory", "model_name", "steps", "per_device_batch_size", "max_target_length",
    "learning_rate", "dataset_type", "dataset_path", "tokenizer_path", "enable_checkpointing", "checkpoint_period",
    "load_parameters_path", "load_full_state_path", "ici_fsdp_parallelism", "dcn_data_parallelism", "log_period",
    "eval_interval", "compiled_trainstep_file",
  ),
)  # fmt: skip


def main(argv: Sequence[str], usage: launch.Usage = USAGE, overrides: Sequence[str] = ()) -> None:
  """argv: sys.argv (the program name first); `overrides` go after it (python3 -m MaxText.rl: objective=grpo)."""
  started = time.perf_counter()  # the summary's total time counts everything from here (tokenizer training too)
  process_started = goodput.program_start()  # goodput's total counts the imports too
  config = launch.start(argv[1:], usage, overrides=overrides)
  if config.log_config and jax.process_index() == 0:
    print(config, flush=True)
  with launch.user_errors(), preemption.lost_processes(config.checkpoint_dir if config.enable_checkpointing else None):
    launch.check_outputs(config)  # before any device work: the mistakes that are knowable now
    saved_config.check(config)
    try:
      summary = run(config, started=started, process_started=process_started)  # raises Stopped after its checkpoint
      nonfinite.check_skipped(summary)  # most updates skipped: exits 1 (docs/failures.md)
    except preemption.Stopped as stopped:
      print(stopped.line(), file=sys.stderr, flush=True)
      sys.exit(preemption.EXIT_STOPPED)
    except (NonFiniteLossError, SkippedUpdatesError) as e:  # the message says what to do
      sys.exit(f"{type(e).__name__}: {e}")
    except rewards.RewardError as e:  # objective=grpo: the user's reward function failed on a row
      sys.exit(f"Reward error: {e} (checkpoints saved before this step are kept)")
    except CheckpointError as e:
      # The save failed (e.g. disk full) and the manager is finished; exit without the interpreter's teardown,
      # where orbax's background threads print "Event loop is closed" tracebacks under the one line.
      print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
      os._exit(1)


if __name__ == "__main__":
  main(sys.argv)
