"""The console scripts of pyproject.toml [project.scripts]: the entry points by name, from any directory.

Each is `python3 MaxText/<name>.py ...` (the same `main(sys.argv)`). They live here, not in launch.py, which
every entry point imports: launch importing them back made a cycle. Each imports only its own entry point.
Also `parser`, the argument parser the command-line tools start from (this module imports nothing heavy, so the
launchers that run on a workstation use it too).
"""

import argparse
import sys


def parser(prog: str, doc: str | None, docs: str) -> argparse.ArgumentParser:
  """An argument parser whose --help prints `doc` as written and ends pointing at `docs` in the repository."""
  return argparse.ArgumentParser(
    prog=prog,
    epilog=f"More: {docs} in the repository.",
    description=doc,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )


def train_command() -> None:
  from MaxText import train

  train.main(sys.argv)


def decode_command() -> None:
  from MaxText import decode

  decode.main(sys.argv)


def train_compile_command() -> None:
  from MaxText import train_compile

  train_compile.main(sys.argv)
