"""Per-device memory of our train step against upstream MaxText's, each as its users install it.

    python3 benchmarks/aot_vs_maxtext.py --maxtext-python /path/to/maxtext-venv/bin/python [words ...]

The interpreter given must have the `maxtext` package (`pip install maxtext==0.2.5` in a Python >= 3.12
venv with the requirements file it ships under dependencies/requirements/generated_requirements/). For
each case of benchmarks/aot_memory.py that MaxText can run with the same arguments (model, batch,
topology, remat policy, attention; the words select cases as there), our MaxText/train_compile.py runs
through this interpreter (`--ours-python` picks another) and MaxText's train_compile through its own, one
after the other; the table gives arguments / temporaries / total GiB per device for each (total =
arguments + outputs - aliased + temporaries, the formula of both reports). The header names both stacks:
the figures compare like for like only where jax and libtpu are the same (they are for our
requirements*.txt and MaxText 0.2.5's: jax 0.12.0.1, libtpu 0.0.52).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import aot_memory  # beside this file (`python3 benchmarks/aot_vs_maxtext.py` imports from its directory)

GIB = 2**30
# MaxText understands these keys with the same meaning; cases with any other (ours only) are skipped.
SHARED_KEYS = {
  "model_name", "compile_topology", "compile_topology_num_slices", "per_device_batch_size", "max_target_length",
  "attention", "remat_policy", "global_parameter_scale",
}  # fmt: skip
STATS = re.compile(r"(?<![a-z_])(argument|output|alias|temp)_size_in_bytes=(\d+)")  # not host_*


def comparable(case: aot_memory.Case) -> bool:
  return all(o.split("=", 1)[0] in SHARED_KEYS for o in case.overrides)


def maxtext_base(python: str) -> str:
  """The path of MaxText's configs/base.yml in `python`'s installation."""
  code = "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))"
  return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def maxtext_run(case: aot_memory.Case, python: str, base: str, out: str) -> dict[str, float] | str:
  """MaxText's train_compile (config `base`) for the case: {args, temp, total} GiB, or the error's last line."""
  overrides = list(case.overrides)
  if not any(o.startswith("compile_topology_num_slices=") for o in overrides):
    overrides.append("compile_topology_num_slices=1")
  name = re.sub(r"[^a-z0-9]+", "_", case.name.lower())
  command = [python, "-m", "maxtext.trainers.pre_train.train_compile", base, f"run_name={name}"]
  command += [f"base_output_directory={out}", *overrides]
  result = subprocess.run(command, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True)
  stats = {k: int(v) / GIB for k, v in STATS.findall(result.stdout + result.stderr)}
  if result.returncode or len(stats) < 4:
    lines = [line for line in (result.stdout + result.stderr).strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else f"exit {result.returncode}"
  total = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]
  return {"args": stats["argument"], "temp": stats["temp"], "total": total}


def versions(python: str) -> str:
  code = (
    "import importlib.metadata as m\n"
    "def v(p):\n  try: return f'{p} {m.version(p)}'\n  except m.PackageNotFoundError: return ''\n"
    "print(', '.join(filter(None, map(v, ('jax', 'libtpu', 'maxtext')))))"
  )
  return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--maxtext-python", required=True, help="a Python with the maxtext package")
  parser.add_argument("--ours-python", default=sys.executable, help="a Python with our requirements (this one)")
  parser.add_argument("words", nargs="*", help="cases whose name contains one of these words (default: all)")
  args = parser.parse_args(argv[1:])
  cases = [c for c in aot_memory.select(args.words) if comparable(c)]
  base = maxtext_base(args.maxtext_python)
  print(f"Ours: {versions(args.ours_python)}. MaxText: {versions(args.maxtext_python)}.")
  print("GiB per device, args / temp / total.\n")
  print("| case | ours | MaxText | ours - MaxText (total) |")
  print("|---|---|---|---|")
  with tempfile.TemporaryDirectory() as out:
    for c in cases:
      ours, theirs = aot_memory.run(c, args.ours_python), maxtext_run(c, args.maxtext_python, base, out)
      mine = f"error: {ours['error']}" if "error" in ours else f"{ours['args']} / {ours['temp']} / {ours['total']}"
      other = theirs if isinstance(theirs, str) else " / ".join(f"{theirs[k]:.2f}" for k in ("args", "temp", "total"))
      delta = ""
      if "error" not in ours and not isinstance(theirs, str):
        delta = f"{float(ours['total']) - theirs['total']:+.2f}"
      print(f"| {c.name} | {mine} | {other} | {delta} |", flush=True)


if __name__ == "__main__":
  main(sys.argv)
