"""What quantized training costs at compile time: train_compile.py for TPU topologies (libtpu on this CPU),
each case with quantization="" (bfloat16) and quantization=int8. Results: benchmarks/quantization.md.

    python3 benchmarks/quantization.py              # every case (each compile is minutes on 2 busy cores)
    python3 benchmarks/quantization.py llama2-7b    # cases whose name contains one of these words

Each compile runs in its own process, as a user would run it; the table shows XLA's FLOPs per device per
step (cost analysis of the compiled program: int8 and bfloat16 operations count alike), the per-device
memory (arguments = state + batch, temporaries, total) and the compile time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
  "llama2-7b v5e-256": ("model_name=llama2-7b", "compile_topology=v5e-256", "per_device_batch_size=4"),
  "16b 2 x v5e-256": (
    "global_parameter_scale=16", "compile_topology=v5e-256", "compile_topology_num_slices=2", "per_device_batch_size=4",
  ),
}  # fmt: skip
MODES = ("", "int8")
REPORT = {
  "seconds": re.compile(r"in ([0-9.]+) s"),
  "args": re.compile(r"arguments ([0-9.]+) GiB"),
  "temp": re.compile(r"temporaries ([0-9.]+) GiB"),
  "total": re.compile(r"total ([0-9.]+) GiB"),
  "flops": re.compile(r"XLA cost analysis FLOPs per device per step: ([0-9.e+]+)"),
}


def command(overrides: tuple[str, ...], mode: str) -> list[str]:
  base = [sys.executable, "MaxText/train_compile.py", "MaxText/configs/base.yml", "log_config=false"]
  return [*base, *overrides, f"quantization={mode}"]


def run(overrides: tuple[str, ...], mode: str) -> dict[str, str]:
  """One compile: {field: text}, or the error's last line as 'error'."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(command(overrides, mode), cwd=ROOT, env=env, capture_output=True, text=True)
  if result.returncode:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return {"error": lines[-1][:160] if lines else f"exit {result.returncode}"}
  found = {k: p.search(result.stdout) for k, p in REPORT.items()}
  return {k: m.group(1) if m else "?" for k, m in found.items()}


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first), then words that select cases."""
  if {"-h", "--help"} & set(argv[1:]):
    print(__doc__.strip())
    sys.exit(0)
  words = argv[1:]
  print("| case | quantization | FLOPs / device / step | args GiB | temp GiB | total GiB | compile s |")
  print("|---|---|---|---|---|---|---|")
  for name, overrides in CASES.items():
    if words and not any(w in name for w in words):
      continue
    for mode in MODES:
      r = run(overrides, mode)
      label = mode or "bfloat16"
      if "error" in r:
        print(f"| {name} | {label} | error: {r['error']} | | | | |", flush=True)
        continue
      row = f"| {name} | {label} | {r['flops']} | {r['args']} | {r['temp']} | {r['total']} | {r['seconds']} |"
      print(row, flush=True)


if __name__ == "__main__":
  main(sys.argv)
