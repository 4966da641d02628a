"""The one start-up path of every entry point (train, decode, train_compile, check_logits, data.inspect).

`start(argv, usage)` answers -h/--help with the entry point's usage, sets up logging, loads the config
and joins the multi-process job (distributed.initialize) before anything touches a device; a user's
mistake exits with one line, "Config error: ...", never a traceback. `user_errors()` gives the same
exit for errors found later (bad mesh, batch, checkpoint path).

A module of its own rather than part of distributed.py: that one is the multi-host start-up plan and is
imported by code that never parses a command line; this one is about the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence

from MaxText import config as config_lib
from MaxText import distributed, paths, preemption
from MaxText.config import Config
from MaxText.errors import ConfigError, DataError, DistributedInitError, ListedConfigError, StorageError

HELP_FLAGS = ("-h", "--help")
BASE_YML = os.path.join(config_lib.CONFIG_DIR, "base.yml")
LOG_HANDLER = "maxtext-launch"  # names our handler on the MaxText logger, so it is added once

# The errors a user's input causes (their messages say what to change), each with the prefix of its
# one-line exit. The one list of them: anything else is a bug in MaxText and keeps its traceback.
USER_ERRORS: tuple[tuple[type[Exception], str], ...] = (
  (ConfigError, "Config error"),
  (DataError, "Data error"),
  (StorageError, "Storage error"),
)
MAX_MESSAGE_CHARS = 600  # a library's message quoted in ours can run to hundreds of lines


@dataclasses.dataclass(frozen=True)
class Usage:
  """What --help prints for one entry point."""

  command: str  # the command line form, e.g. "python3 MaxText/train.py CONFIG.yml [key=value ...]"
  summary: str  # what the entry point does, one line
  keys: tuple[str, ...] = ()  # the config keys it reads most, shown with their base.yml comments
  options: tuple[tuple[str, str], ...] = ()  # its own key=value options (not config keys) and their help

  def text(self) -> str:
    lines = [f"usage: {self.command}", "", self.summary]
    if self.options:
      lines += ["", "Options of this command (key=value):"]
      lines += [f"  {name:<28} {text}" for name, text in self.options]
    comments = _key_comments()
    lines += ["", "Config keys it reads most (key=value overrides the config file):"]
    lines += [f"  {key:<28} {comments.get(key, '')}".rstrip() for key in self.keys]
    lines += ["", f"Every key, with its default and meaning: {os.path.relpath(BASE_YML)}"]
    lines += [f"Recipe names usable in place of CONFIG.yml (MaxText/configs/): {', '.join(config_lib.recipes())}"]
    lines += ["Guide: README.md and docs/ in the repository."]
    return "\n".join(lines)


def _key_comments() -> dict[str, str]:
  """key -> its one-line comment in base.yml (every key has one)."""
  comments = {}
  with open(BASE_YML) as f:
    for line in f:
      match = re.match(r"^(\w+):.*?\s#\s*(.*)$", line)
      if match:
        comments[match.group(1)] = match.group(2).strip()
  return comments


def setup_logging() -> None:
  """Our own progress messages (MaxText.*: data preparation, loading, ...) at INFO on stderr;
  libraries stay at their defaults. Idempotent: entry points called twice in one process log once."""
  logger = logging.getLogger("MaxText")
  logger.setLevel(logging.INFO)
  logger.propagate = False  # libraries that configure the root logger would print each line twice
  if not any(h.get_name() == LOG_HANDLER for h in logger.handlers):
    handler = logging.StreamHandler()
    handler.set_name(LOG_HANDLER)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)


def one_line(prefix: str, error: BaseException) -> str:
  """`prefix: message` on one line: the message's first line (what was wrong and how to fix it comes first;
  a quoted library message follows), cut to MAX_MESSAGE_CHARS; a ListedConfigError whole (its lines are a list
  the user needs in full)."""
  if isinstance(error, ListedConfigError):  # our own listing: every line is needed
    return f"{prefix}: {error}"
  lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
  text = lines[0] + (f" [{len(lines) - 1} more lines omitted]" if len(lines) > 1 else "")
  if len(text) > MAX_MESSAGE_CHARS:
    text = text[: MAX_MESSAGE_CHARS - 3] + "..."
  return f"{prefix}: {text}"


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
  """An error of USER_ERRORS (a user's mistake: the message says what to change) exits 1 with one line."""
  try:
    yield
  except tuple(kind for kind, _ in USER_ERRORS) as e:
    prefix = next(prefix for kind, prefix in USER_ERRORS if isinstance(e, kind))
    sys.exit(one_line(prefix, e))


def check_outputs(config: Config) -> None:
  """ConfigError naming the key when a local output location cannot be written, StorageError when a gs://
  one is not a writable bucket (checked before any device work, not when the first checkpoint or metrics
  line is due). Only process 0 writes outputs, so only it checks."""
  check_output_dir("base_output_directory", config.run_dir)
  check_output_file("metrics_file", config.metrics_file, "metrics.jsonl")


def check_output_file(key: str, file: str, example: str) -> None:
  """check_output_dir for the directory of the file that `key` names, and the file is not a directory
  (the error suggests `example` inside it)."""
  if paths.is_local_dir(file):
    raise ConfigError(f"{key}={file!r} is a directory; name a file, e.g. {paths.join(file, example)}")
  check_output_dir(key, paths.dirname(file))


def check_output_dir(key: str, path: str) -> None:
  """ConfigError naming `key` when the local directory `path` cannot be made or written (StorageError for a
  gs:// one that is not a writable bucket, checked on process 0 only); '' passes."""
  if paths.checked_remote_output(path, key, lambda: jax_process_index() == 0) or not path:
    return
  existing = os.path.abspath(path)
  while not os.path.exists(existing):  # the nearest existing ancestor is where directories get made
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(f"{key}: {existing!r} is a file, so {path!r} cannot be a directory; choose another {key}")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"{key}: cannot write under {existing!r} (permission denied); choose a writable {key}")
  try:  # os.access says yes to root everywhere, /proc and read-only mounts included: make a directory there
    os.rmdir(tempfile.mkdtemp(prefix=".maxtext-check-", dir=existing))
  except OSError as e:
    raise ConfigError(f"{key}: cannot write under {existing!r} ({e.strerror}); choose a writable {key}") from None


def export_main(
  argv: Sequence[str],
  module: str,
  doc: str | None,
  docs: str,
  output: str,
  dtypes: Sequence[str],
  export: Callable[[Config, str, str], None],
) -> str:
  """The command line the exporters of a checkpoint share (convert.maxtext_to_hf, convert.to_upstream):
  CONFIG.yml load_parameters_path=... [key=value ...] --output DIR [--dtype D] -> export(config, DIR, D), the
  config loaded in float32, on CPU; a bad config or path exits 1 with one line. Returns DIR. `output`: the help
  of --output."""
  parser = argparse.ArgumentParser(
    prog=f"python3 -m {module}",
    epilog=f"More: {docs} in the repository.",
    description=doc,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("config", nargs="+", help="CONFIG.yml load_parameters_path=... [key=value ...]")
  parser.add_argument("--output", required=True, help=output)
  parser.add_argument("--dtype", default="float32", choices=dtypes, help="dtype of the written arrays")
  args = parser.parse_args(argv[1:])
  import jax  # lazy, as in jax_process_index

  jax.config.update("jax_platforms", "cpu")
  try:
    export(config_lib.load([*args.config, "dtype=float32"]), args.output, args.dtype)
  except ConfigError as e:
    sys.exit(one_line("Conversion error", e))
  except StorageError as e:
    sys.exit(one_line("Storage error", e))
  return args.output


def jax_process_index() -> int:
  import jax  # lazy: --help and config errors answer without importing jax

  return jax.process_index()


def doc_help(argv: Sequence[str], doc: str | None) -> None:
  """For scripts whose module docstring is their usage (benchmarks, helpers): -h/--help prints it, exits 0."""
  if any(arg in HELP_FLAGS for arg in argv):
    print((doc or "").strip(), flush=True)
    sys.exit(0)


def start(argv: Sequence[str], usage: Usage, *, overrides: Sequence[str] = (), join_job: bool = True) -> Config:
  """The config of `argv` (the arguments after the program: CONFIG.yml [key=value ...], then
  `overrides`), with logging set up and, when join_job, this process in its multi-process job.

  Exits 0 after printing the usage for -h/--help; exits 1 with one line on a config or start-up error.
  """
  if any(arg in HELP_FLAGS for arg in argv):
    print(usage.text(), flush=True)
    sys.exit(0)
  if not argv:  # no config at all: the usage, not an error about a missing argument
    print(usage.text(), file=sys.stderr, flush=True)
    sys.exit(2)
  setup_logging()
  preemption.install_startup_handlers()  # a signal now exits with one line; train.run takes over later
  with user_errors():
    config = config_lib.load([*argv, *overrides])
  if join_job:
    if config.hardware == "tpu" and not distributed.on_tpu_vm():  # else a 20 s wait for TPU metadata, misreported
      sys.exit("Config error: hardware=tpu but this machine has no TPU chips; set hardware=auto or run on a TPU VM")
    try:
      distributed.initialize(config)  # before anything touches a device
    except DistributedInitError as e:
      sys.exit(f"Distributed initialisation failed: {e}")
  return config
