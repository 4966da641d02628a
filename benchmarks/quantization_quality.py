"""Training quality of quantized training: the quick-start run in bfloat16, int8 and fp8 at the same steps.

    python3 benchmarks/quantization_quality.py                  # 200 steps per mode (minutes each on 2 idle cores)
    python3 benchmarks/quantization_quality.py steps=400 fp8=   # key=value overrides for every run

Each mode runs `MaxText/train.py MaxText/configs/quickstart.yml quantization=<mode>` in its own process on
this machine's CPU (fp8 is emulated there: XLA:CPU upcasts fp8 operands, so it shows fp8's rounding, not
its speed) with the same data order and seed; the tokenizer and token cache of the first run are copied to
the others so they read identical batches. The table: final training loss (mean of the last 3 logged
steps), held-out eval loss at the last step, their difference from bfloat16 in percent, and the steps/s.
The target is int8 within 2% of bfloat16 (docs/quantization.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"bfloat16": "", "int8": "int8", "fp8": "fp8"}


def run(out: str, name: str, mode: str, overrides: list[str]) -> list[dict]:
  """One quick-start run; its metrics records."""
  command = [sys.executable, "MaxText/train.py", "MaxText/configs/quickstart.yml", f"run_name={name}"]
  command += [f"base_output_directory={out}", f"quantization={mode}", "steps=200", "eval_interval=200"]
  command += ["enable_checkpointing=false", "log_period=10", *overrides]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
  if result.returncode:
    raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
  with open(os.path.join(out, name, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def summary(records: list[dict]) -> dict[str, float]:
  train = [r for r in records if "loss" in r]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  timed = [r["step_time_s"] for r in train[1:] if "step_time_s" in r]  # the first step compiles
  return {
    "loss": sum(r["loss"] for r in train[-3:]) / len(train[-3:]),
    "eval": evals[-1] if evals else float("nan"),
    "steps_per_s": len(timed) / sum(timed) if timed else float("nan"),
    "steps": train[-1]["step"],
  }


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first), then key=value overrides for every run."""
  if {"-h", "--help"} & set(argv[1:]):
    print(__doc__.strip())
    sys.exit(0)
  overrides = argv[1:]
  out = tempfile.mkdtemp(prefix="quant_quality_")
  results = {}
  for label, mode in MODES.items():
    name = f"q_{label}"
    if results:  # same tokenizer and token cache as the first run: identical batches
      first = os.path.join(out, f"q_{next(iter(MODES))}", "tokenizer")
      shutil.copytree(first, os.path.join(out, name, "tokenizer"))
    results[label] = summary(run(out, name, mode, overrides))
    print(f"{label}: {results[label]}", flush=True)
  ref = results["bfloat16"]
  print("\n| mode | steps | final train loss | vs bf16 | eval loss | vs bf16 | steps/s |")
  print("|---|---|---|---|---|---|---|")
  for label, r in results.items():
    loss, evals = (f"{100 * (r[k] - ref[k]) / ref[k]:+.2f}%" for k in ("loss", "eval"))
    print(f"| {label} | {r['steps']} | {r['loss']:.4f} | {loss} | {r['eval']:.4f} | {evals} | {r['steps_per_s']:.2f} |")
  shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
  main(sys.argv)
