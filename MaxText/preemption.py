"""Signals, preemption and lost processes: stop at a step boundary with a checkpoint, or exit with one line.

Exit statuses (documented in docs/failures.md):

- EXIT_STOPPED (75): SIGTERM, SIGINT or SIGHUP during training; the run saved a checkpoint at the step it
  names (unless checkpointing is off) and a restart with the same run_name resumes there. 75 is
  sysexits' EX_TEMPFAIL, "try again later", which is what a preempted run wants from its scheduler.
- 128 + signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP): a second signal during the stop, or any signal
  before training starts (nothing to save yet); the shell's own convention for "killed by a signal".
- EXIT_PROCESS_LOST (76): another process of a multi-process job died; this one stops at once.

How the processes of a job agree on the step: every step boundary each process contributes the signal
it has seen (0: none) to a max all-reduce over all devices, read one step later (by then the step that
follows it has completed anyway, so the read does not stall the device). Every process reads the same
reduction at the same boundary, so all stop after the same step and save the same checkpoint. This is
a small collective per step of our own rather than JAX's preemption sync manager, because that one
hears only SIGTERM (not SIGINT or SIGHUP), swallows it with a log line when nobody asks, and cannot
be told about a signal a Python handler caught.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # jax and numpy are imported where used: entry points import this module before them
  import jax
  from jax.sharding import Mesh

EXIT_STOPPED = 75
EXIT_PROCESS_LOST = 76
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _name(signum: int) -> str:
  return signal.Signals(signum).name


class Stopped(Exception):
  """Training stopped on a signal after `step` steps; raised once the checkpoint (if any) is written."""

  def __init__(self, step: int, signum: int, checkpoint: str | None, here: bool):
    self.step, self.signum, self.checkpoint, self.here = step, signum, checkpoint, here
    super().__init__(self.line())

  def line(self) -> str:
    who = "received" if self.here else "received by another process of this job"
    saved = f"checkpoint saved to {self.checkpoint}" if self.checkpoint else "checkpointing is off, nothing saved"
    return (
      f"Stopped at step {self.step}: {_name(self.signum)} {who}; {saved}. Restart with the same run_name to "
      f"resume (exit status {EXIT_STOPPED})."
    )


def _exit_now(signum: int, when: str) -> None:
  """One line on stderr, then exit 128 + signum without unwinding (no atexit, no waiting for saves)."""
  sys.stderr.write(f"{_name(signum)} {when}: exiting at once with status {128 + signum}.\n")
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(128 + signum)


def _ignore(signum: int, frame: FrameType | None) -> None:
  """The Python-level handler does nothing: the listener thread acts on the signal (see _Listener)."""


def _at_startup(signum: int) -> None:
  _exit_now(signum, "received outside the training loop (nothing to save)")


class _Listener:
  """Acts on SIGNALS from a thread of its own, so even while the main thread sits in C++ (an XLA
  compile, jax.distributed connecting, a blocking save) a signal is seen at once.

  Python's C-level handler writes each signal's number to the wakeup fd as it arrives, whatever the
  main thread is doing; Python-level handlers would run only when the main thread next executes
  bytecode, and an exception raised there (KeyboardInterrupt) can surface inside C++ callbacks: the
  old SIGINT-during-compile segfault. `on_signal` is swapped by whoever owns the phase of the run.
  """

  def __init__(self) -> None:
    self.on_signal: Callable[[int], None] = _at_startup
    read_fd, self._write_fd = os.pipe()
    os.set_blocking(self._write_fd, False)  # the C handler must never block
    self._handlers = {signum: signal.signal(signum, _ignore) for signum in SIGNALS}
    self._wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
    threading.Thread(target=self._listen, args=(read_fd,), name="signal-listener", daemon=True).start()
    # Forked children (data-loading workers) would write their own Ctrl-C into our pipe: one key press
    # would look like a second signal. They get the previous handling back instead.
    os.register_at_fork(after_in_child=self._forget_in_child)

  def _listen(self, read_fd: int) -> None:
    while data := os.read(read_fd, 64):  # b"": close() closed the write end
      for signum in data:
        if signum in SIGNALS:
          self.on_signal(signum)
    os.close(read_fd)

  def _forget_in_child(self) -> None:
    global _listener
    if _listener is self:
      _listener = None
      with contextlib.suppress(ValueError, OSError):  # ValueError: forked from a thread other than main
        self.close()

  def close(self) -> None:
    """Give the process its previous signal handling back (train.run called in-process, as tests do)."""
    signal.set_wakeup_fd(self._wakeup)
    for signum, handler in self._handlers.items():
      signal.signal(signum, handler)
    os.close(self._write_fd)


_listener: _Listener | None = None


def listener() -> _Listener | None:
  """The process's signal listener, started on first use; None off the main thread (signal.signal and
  set_wakeup_fd work only there, e.g. train.run called from a worker thread keeps default handling)."""
  global _listener
  if _listener is None and threading.current_thread() is threading.main_thread():
    _listener = _Listener()
  return _listener


def install_startup_handlers() -> None:
  """From now on a signal exits at once with one line (launch.start calls this before loading the config):
  there is nothing to save before the first training step. train.run's Watch takes over for training."""
  listener()


# The programs launch.start starts: as this process's program, they get the start-up handling when the MaxText
# package is first imported, before the seconds of imports (jax, flax, orbax...) that precede launch.start.
ENTRY_POINTS = ("MaxText.train", "MaxText.decode", "MaxText.train_compile", "MaxText.check_logits", "MaxText.rl")
ENTRY_POINTS += ("MaxText.data.inspect",)


def program() -> str:
  """The module this process runs as its program ("MaxText.train" for `python3 MaxText/train.py` or
  `python3 -m MaxText.train`); "" for a script outside the package, -c or an interactive session."""
  first = sys.argv[0] if sys.argv else ""
  if first == "-m":  # python3 -m X: while X's packages import, sys.argv[0] is "-m"
    argv = list(getattr(sys, "orig_argv", ()))
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
  package = os.path.dirname(os.path.abspath(__file__))
  path = os.path.abspath(first) if first.endswith(".py") else ""
  if not path.startswith(package + os.sep):
    return ""
  return "MaxText." + os.path.relpath(path, package)[: -len(".py")].replace(os.sep, ".")


def install_for_entry_point() -> None:
  """install_startup_handlers() when this process runs one of ENTRY_POINTS (MaxText/__init__.py calls it)."""
  if program() in ENTRY_POINTS:
    install_startup_handlers()


class Watch:
  """Context manager for the training loop: the first SIGTERM/SIGINT/SIGHUP asks for a stop at the next
  step boundary (`stop_signal`), a second one exits at once. On exit the previous behaviour returns."""

  def __init__(self, mesh: Mesh):
    import jax  # noqa: PLC0415 (see the imports)
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: PLC0415

    self.signum = 0  # the first signal this process received; 0: none
    self.multi = jax.process_count() > 1
    self._pending: jax.Array | None = None  # the reduction dispatched at the previous boundary
    self._previous: Callable[[int], None] | None = None
    if self.multi:
      flat = Mesh(np.asarray(mesh.devices).reshape(-1), ("all",))
      self._sharding = NamedSharding(flat, PartitionSpec("all"))
      self._local = len(flat.local_devices)
      self._max = jax.jit(lambda x: x.max(), out_shardings=NamedSharding(flat, PartitionSpec()))

  def _on_signal(self, signum: int) -> None:
    if self.signum:
      _exit_now(signum, f"received while stopping after {_name(self.signum)}")
    self.signum = signum
    sys.stderr.write(f"{_name(signum)} received: stopping at the next step boundary (a second signal exits now).\n")
    sys.stderr.flush()

  def __enter__(self) -> Watch:
    self._owns_listener = _listener is None  # no launch.start before: give the handlers back afterwards
    if (listen := listener()) is not None:
      self._previous, listen.on_signal = listen.on_signal, self._on_signal
    return self

  def __exit__(self, *exc: Any) -> None:
    global _listener
    if self._previous is None or _listener is None:
      return
    _listener.on_signal = self._previous
    if self._owns_listener:
      _listener.close()
      _listener = None

  def stop_signal(self) -> int:
    """At a step boundary: the signal every process agrees to stop on now, or 0 to go on. Call it at
    every boundary on every process (multi-process: it takes part in a collective)."""
    if not self.multi:
      return self.signum
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    local = np.full((self._local,), self.signum, np.int32)
    flags = jax.make_array_from_process_local_data(self._sharding, local, (self._sharding.mesh.size,))
    previous, self._pending = self._pending, self._max(flags)
    return 0 if previous is None else int(np.asarray(previous.addressable_data(0)))


# ---------------------------------------------------------------------------------------------- lost processes

WATCH_PERIOD_S = 1.0  # how often the processes ask the coordinator which of them are alive
LEAVE_GRACE_S = 0.5  # process 0, exiting: time for a peer that has just disconnected to finish its own exit


def latest_checkpoint(checkpoint_dir: str) -> int | None:
  """The newest complete step under checkpoint_dir (orbax renames a step's directory when complete)."""
  from MaxText import checkpointing  # here, not at the top: launch imports this module before any orbax is needed

  steps = checkpointing.committed_steps(checkpoint_dir)
  return steps[-1] if steps else None


def _job() -> tuple[int, int]:
  """(this process, processes in the job) as jax.distributed was told: known before any device is touched."""
  from jax._src import distributed as jax_distributed

  state = jax_distributed.global_state
  return state.process_id, state.num_processes


def lost_processes_message(cause: str, checkpoint_dir: str | None, lost: Sequence[int] = ()) -> str:
  """One line: which process was lost (`lost`; else the one other process, or 'a process') and where a
  restart resumes."""
  me, count = _job()
  if not lost and count == 2:
    lost = [1 - me]
  if not lost and _peer_watch is not None:
    lost = _peer_watch.lost
  who = ("process " if len(lost) == 1 else "processes ") + ", ".join(map(str, lost)) if lost else "a process"
  step = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
  resume = f"from checkpoint {step} ({checkpoint_dir}/{step})" if step is not None else "from the start (no checkpoint)"
  return (
    f"Lost {who} of this {count}-process job ({cause[:200]}); process {me} stops. "
    f"Restart the whole job: it resumes {resume} (exit status {EXIT_PROCESS_LOST})."
  )


def _first_line(error: BaseException) -> str:
  """The error's message's first line (its type's name when it has none): the cause in the lost-process line."""
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def _exit_lost(cause: str, checkpoint_dir: str | None, lost: Sequence[int] = ()) -> None:
  """The one line, then exit 76 without unwinding: JAX's atexit shutdown would wait for the dead process."""
  sys.stderr.write(lost_processes_message(cause, checkpoint_dir, lost) + "\n")
  sys.stderr.flush()
  sys.stdout.flush()
  if _job()[0] == 0:
    # The coordinator goes with this process. A peer seen leaving may be one that exits on an error of its
    # own, still between its disconnect and the end of its error polling; JAX would abort it if the
    # coordinator vanished in between.
    time.sleep(LEAVE_GRACE_S)
  os._exit(EXIT_PROCESS_LOST)


class _PeerWatch:
  """A thread that asks JAX's coordination service every WATCH_PERIOD_S which processes are alive and exits
  76 with the lost-process line once one is not.

  JAX's service counts a process as dead once it has missed jax_distributed_heartbeat_timeout of heartbeats.
  By default it then ends every other process with a C++ abort, and a survivor's gloo collective on CPU
  waits for the dead peer rather than fail, so nothing in Python would see the loss: distributed.initialize
  turns on jax_enable_recoverability (no abort) and starts this watch instead. `get_live_nodes` is a barrier
  among the live processes (every process's watch takes part in each round), so a round ends as soon as all
  live processes have asked, or when the dead one's heartbeats have timed out.

  Recoverable, JAX's exit no longer waits for the other processes, so `leave` does (at exit, before JAX's
  own shutdown): all processes meet at a barrier, then process 0, whose coordinator the others still use
  while they disconnect, waits until they have gone.
  """

  def __init__(self, client: Any, checkpoint_dir: str | None, heartbeat_timeout: float):
    self.client, self.checkpoint_dir, self.heartbeat_timeout = client, checkpoint_dir, heartbeat_timeout
    self.me, self.count = _job()
    self.lost: list[int] = []
    self.leaving = threading.Event()  # this process is exiting: the others going away is expected
    self.alone = threading.Event()  # process 0, leaving: every other process has disconnected
    # atexit runs last-registered first: this runs before JAX's own handler shuts the client down.
    atexit.register(self.leave)
    threading.Thread(target=self._watch, name="lost-process-watch", daemon=True).start()

  def _watch(self) -> None:
    everyone = list(range(self.count))
    while not self.leaving.wait(WATCH_PERIOD_S) or (self.me == 0 and not self.alone.is_set()):
      try:
        live = set(self.client.get_live_nodes(everyone))
      except Exception as e:  # the coordinator (process 0) is gone, or this client is shutting down
        if not self.leaving.is_set():
          cause = f"the coordinator does not answer: {_first_line(e)}"
          _exit_lost(cause, self.checkpoint_dir, [0] if self.me else [])
        self.alone.set()  # leaving: nobody left to wait for
        return
      if self.leaving.is_set():
        if live == {self.me}:
          self.alone.set()
        continue
      self.lost = [p for p in everyone if p not in live]
      if self.lost:
        cause = f"it exited, or sent no heartbeat for jax_distributed_heartbeat_timeout={self.heartbeat_timeout:g} s"
        _exit_lost(cause, self.checkpoint_dir, self.lost)

  def leave(self) -> None:
    """At exit: wait (up to the heartbeat timeout each) for every process to get here, then, on process 0,
    for the others to disconnect; a process that never comes is not waited for twice."""
    self.leaving.set()
    try:
      self.client.wait_at_barrier("maxtext_exit", int(self.heartbeat_timeout * 1000))
    except Exception:  # a process did not come (it failed, or it is still working): nothing to wait for
      return
    if self.me == 0 and self.alone.wait(self.heartbeat_timeout):
      time.sleep(LEAVE_GRACE_S)


def wait_for_the_others_to_leave(client: Any, count: int, timeout: float) -> None:
  """Process 0, exiting while no watch runs (distributed.check_job_size): return once the other processes
  have disconnected (or after `timeout` s), so that the coordinator, which goes with this process, outlives
  their own exit; JAX, recoverable, does not wait for them itself."""
  deadline = time.monotonic() + timeout
  with contextlib.suppress(Exception):
    while len(client.get_live_nodes(list(range(count)))) > 1 and time.monotonic() < deadline:
      time.sleep(0.1)
  time.sleep(LEAVE_GRACE_S)


_peer_watch: _PeerWatch | None = None


def watch_peers(checkpoint_dir: str | None, heartbeat_timeout: float) -> None:
  """Multi-process runs (called by distributed.initialize): exit 76 with one line naming the lost process
  within jax_distributed_heartbeat_timeout of its death, whatever this process is doing then."""
  from jax._src import distributed as jax_distributed

  global _peer_watch
  if jax_distributed.global_state.client is not None and _peer_watch is None:
    logging.getLogger("absl").addFilter(_PEER_LOST_FILTER)  # orbax logs through absl
    _peer_watch = _PeerWatch(jax_distributed.global_state.client, checkpoint_dir, heartbeat_timeout)


PEER_LOST = re.compile(r"gloo|connection|peer|unavailable|socket|heartbeat|coordination", re.IGNORECASE)
# A failed collective can also surface as a ValueError carrying XLA's status (a jitted call that reports the
# error of the previous asynchronous one); ours (ConfigError, DataError) never start with a status code.
XLA_STATUS = re.compile(r"^(UNKNOWN|UNAVAILABLE|INTERNAL|ABORTED|CANCELLED|DEADLINE_EXCEEDED|FAILED_PRECONDITION): ")


def _peer_lost(error: BaseException) -> bool:
  """Whether `error` is a collective or the coordinator failing because another process is gone."""
  if isinstance(error, ValueError) and not XLA_STATUS.match(str(error)):
    return False
  return bool(PEER_LOST.search(str(error)))


class _PeerLostTracebacks(logging.Filter):
  """orbax logs a full traceback from a background save thread whose collective failed because a process
  died; the lost-process line says what happened, so those records keep their one-line message only."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and record.exc_info[1] is not None and _peer_lost(record.exc_info[1]):
      record.exc_info, record.exc_text = None, None
    return True


_PEER_LOST_FILTER = _PeerLostTracebacks()


@contextlib.contextmanager
def lost_processes(checkpoint_dir: str | None) -> Iterator[None]:
  """Multi-process runs: a runtime error from the collectives (a peer died: gloo's 'connection reset',
  a DCN failure) exits at once with one line. os._exit, because JAX's atexit shutdown would wait for
  the dead process and then abort with a C++ stack."""
  try:
    yield
  except Exception as e:
    import jax  # noqa: PLC0415 (loaded by now: whatever raised ran on it)

    if not isinstance(e, (jax.errors.JaxRuntimeError, ValueError)) or _job()[1] <= 1 or not _peer_lost(e):
      raise
    _exit_lost(_first_line(e), checkpoint_dir)
