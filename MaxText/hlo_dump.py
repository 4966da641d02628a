"""dump_hlo: XLA's dump of the compiled train (and eval) step, in the run directory, with MaxText's keys.

With dump_hlo=true the steps are jitted with XLA's dump options (train_step.step_compiler_options):
`xla_dump_to` (the dump directory), `xla_dump_hlo_as_text`, `xla_dump_large_constants` and
`xla_dump_hlo_module_re` (dump_hlo_module_name; "" dumps every module), then the `--xla_*` words of
dump_hlo_xla_flags, which win. They are options of those compilations rather than XLA_FLAGS, so they take
effect however late they are set (XLA reads XLA_FLAGS once, when the backend starts) and reach libtpu when
train_compile.py compiles for a TPU topology. XLA writes each module before and after optimisation:
module_NNNN.jit_train_step.before_optimizations.txt, ...<platform>_after_optimizations.txt, and the buffer
assignment and memory report beside them.

Where: XLA writes to dump_hlo_local_dir, else to <run dir>/hlo when the run directory is local (and then
nothing is copied), else to a directory under the system's temporary directory. Process 0 copies that
directory to dump_hlo_gcs_dir (local or gs://; default <run dir>/hlo) once the step has compiled
(publish, called by train.py at the end of the run and by train_compile.py after compiling).
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import yaml

from MaxText import paths
from MaxText.errors import ConfigError

DIR_NAME = "hlo"  # under the run directory


def parse_flags(text: str) -> dict[str, Any]:
  """`--xla_name=value --xla_flag ...` -> {"xla_name": value, "xla_flag": True}, values typed as YAML reads
  them (true/false, numbers), as XLA's compile options need; ConfigError for a word of another form."""
  options = {}
  for word in text.split():
    name, has_value, value = word.partition("=")
    if not name.startswith("--xla_") or not name[2:].replace("_", "").isalnum():
      raise ConfigError(
        f"dump_hlo_xla_flags: {word!r} is not an XLA flag; give words of the form --xla_<name>=<value>, "
        "e.g. dump_hlo_xla_flags='--xla_dump_hlo_as_proto --xla_dump_hlo_pass_re=.*'"
      )
    options[name[2:]] = _typed(value) if has_value else True
  return options


def check_keys(c: dict[str, Any]) -> None:
  """The dump_hlo_* keys of a config being loaded (config_checks.validate runs this): XLA writes the dump to a
  local directory; the module name is a regex."""
  flags = parse_flags(c["dump_hlo_xla_flags"])
  for key, where in (("dump_hlo_local_dir", c["dump_hlo_local_dir"]), ("dump_hlo_xla_flags", flags.get("xla_dump_to"))):
    if where:
      advice = f"XLA writes its dump to a local directory; set dump_hlo_gcs_dir={where!r} to have it copied there"
      paths.check_local(str(where), key, advice)
  try:
    re.compile(c["dump_hlo_module_name"])
  except re.error as e:
    raise ConfigError(f"dump_hlo_module_name={c['dump_hlo_module_name']!r} is not a regular expression: {e}") from None


def _typed(value: str) -> Any:
  try:
    typed = yaml.safe_load(value)
  except yaml.YAMLError:
    return value
  return typed if isinstance(typed, (bool, int, float)) else value


def local_dir(config: Any) -> str:
  """Where XLA writes the dump on this machine."""
  given = parse_flags(config.dump_hlo_xla_flags).get("xla_dump_to")
  if given:
    return str(given)
  if config.dump_hlo_local_dir:
    return config.dump_hlo_local_dir
  stand_in = os.path.join(tempfile.gettempdir(), "maxtext_hlo", config.run_name)
  return paths.local_or(paths.join(config.run_dir, DIR_NAME), stand_in)


def target_dir(config: Any) -> str:
  """Where the dump is kept: dump_hlo_gcs_dir, else <run dir>/hlo."""
  return config.dump_hlo_gcs_dir or paths.join(config.run_dir, DIR_NAME)


def compiler_options(config: Any) -> dict[str, Any]:
  """The XLA options that dump a step's compilation; {} without dump_hlo."""
  if not config.dump_hlo:
    return {}
  options = {"xla_dump_to": local_dir(config), "xla_dump_hlo_as_text": True, "xla_dump_large_constants": True}
  if config.dump_hlo_module_name:
    options["xla_dump_hlo_module_re"] = config.dump_hlo_module_name
  return {**options, **parse_flags(config.dump_hlo_xla_flags)}


def publish(config: Any, is_writer: bool) -> str | None:
  """Copy the dump to target_dir when XLA wrote it elsewhere (writer process only); returns where the dump
  is (None without dump_hlo, or when XLA wrote nothing: a step loaded from compiled_trainstep_file, or no
  module matched dump_hlo_module_name)."""
  if not config.dump_hlo or not is_writer:
    return None
  source, target = local_dir(config), target_dir(config)
  if not os.path.isdir(source) or not os.listdir(source):
    print(
      f"dump_hlo: XLA wrote no HLO to {source} (no step was compiled here, or none matched "
      f"dump_hlo_module_name={config.dump_hlo_module_name!r})",
      flush=True,
    )
    return None
  if paths.absolute(source) != paths.absolute(target):
    paths.copy_tree(source, target)
  print(f"dump_hlo: the compiled step's HLO is in {target}", flush=True)
  return target
