"""The console scripts of pyproject.toml [project.scripts]: the entry points by name, from any directory.

Each is `python3 MaxText/<name>.py ...` (the same `main(sys.argv)`). They live here, not in launch.py, which
every entry point imports: launch importing them back made a cycle. Each imports only its own entry point.
"""

import sys


def train_command() -> None:
  from MaxText import train

  train.main(sys.argv)


def decode_command() -> None:
  from MaxText import decode

  decode.main(sys.argv)


def train_compile_command() -> None:
  from MaxText import train_compile

  train_compile.main(sys.argv)
