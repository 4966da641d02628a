"""MaxText-style LLM training in pure Python/JAX."""

import sys

if sys.version_info < (3, 12):  # noqa: UP036 (jax >= 0.11, which requirements.txt pins, needs 3.12)
  sys.exit(
    f"MaxText needs Python >= 3.12 (this is {sys.version.split()[0]}): run `bash setup.sh`, "
    "then `source .venv/bin/activate`, and run the command again"
  )
