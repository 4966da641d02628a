"""The first check on an NVIDIA GPU (benchmarks/gpu_check.sh runs it): a dated Markdown table in benchmarks/gpu/.

  python3 -m benchmarks.gpu_check [--layers=8] [--batch=2] [--length=4096] [--timed=5] [--smoke]

1. the `gpu`-marked tests (pytest -m gpu, on the GPU);
2. a llama2-7b-shaped model cut to --layers layers (bfloat16, remat full, one GPU): the real train step with
   cuDNN flash attention, with dot_product attention on the same first batch (its loss must agree), and with
   fp8 matmuls; per row the first step's loss, step time, tokens/s, TFLOP/s, MFU (6·N·T plus attention over
   the table peak of accelerators.py), XLA's memory figure for the compiled step (what train_compile.py
   reports ahead of time) next to the device's measured peak, and the compile time.
--smoke runs the same on this host's CPU with a tiny model (checks the script itself, no GPU needed; nothing
is written unless --out is given).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import jax

from benchmarks import train_benchmark as tb
from MaxText import accelerators, config, flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
LLAMA2_7B = [
  "model_name=llama2-7b",
  "override_model_config=true",
  "dtype=bfloat16",
  "remat_policy=full",
  "scan_layers=true",
]
TINY = [
  "vocab_size=256",
  "base_emb_dim=64",
  "base_num_query_heads=4",
  "base_num_kv_heads=4",
  "base_mlp_dim=128",
  "head_dim=16",
]
ROWS = {  # name: overrides on top of the model's
  "cuDNN flash attention": ["attention=cudnn_flash_te"],
  "dot_product attention": ["attention=dot_product"],
  "cuDNN flash + fp8 matmuls": ["attention=cudnn_flash_te", "quantization=fp8"],
}


def gpu_tests() -> str:
  """pytest -m gpu on the GPU: its last line (passed/failed counts) and the exit status."""
  env = {**os.environ, "JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  cmd = [sys.executable, "-m", "pytest", "MaxText/tests", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "0"]
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
  return f"`{' '.join(cmd[1:])}`: {last} (exit {done.returncode})"


def measure(argv: list[str], timed: int) -> dict:
  """One row: compile, the first step's loss on the first batch, then the mean of `timed` steps."""
  c = config.load(argv)
  run = tb.prepare(c)
  run.state, metrics = run.compiled(run.state, next(run.batches), jax.random.key(0))
  loss = float(metrics["loss"])
  run.step = 1
  run.advance(1)
  step_s = run.advance(timed)
  device = jax.devices()[0]
  peak = accelerators.peak_flops_per_device(dtype=c.dtype)
  mem = run.compiled.memory_analysis()
  compiled = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) if mem else 0
  stats = device.memory_stats() or {}
  return {
    "first loss": loss,
    "step (s)": step_s,
    "tokens/s/device": run.tokens / step_s / run.devices,
    "TFLOP/s/device": run.flops / step_s / run.devices / 1e12,
    "MFU": flops.mfu(run.flops, step_s, run.devices, peak),
    "compiled GiB": compiled / GiB,
    "peak GiB": stats.get("peak_bytes_in_use", 0) / GiB,
    "compile (s)": run.compile_s,
    "params": run.params,
  }


def markdown(rows: dict[str, dict]) -> str:
  head = list(next(iter(rows.values())))
  lines = ["| setting | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
  for name, r in rows.items():
    lines.append(f"| {name} | " + " | ".join(tb._fmt(k, r[k]) for k in head) + " |")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  flags = dict(a[2:].partition("=")[::2] for a in argv[1:] if a.startswith("--"))
  smoke = "smoke" in flags
  layers, batch = int(flags.get("layers", 2 if smoke else 8)), flags.get("batch", "1" if smoke else "2")
  length, timed = flags.get("length", "64" if smoke else "4096"), int(flags.get("timed", 2 if smoke else 5))
  device = jax.devices()[0]
  if device.platform != "gpu" and not smoke:
    sys.exit(f"gpu_check: the first JAX device is {device.device_kind} ({device.platform}), not a GPU")
  started = time.perf_counter()
  base = [os.path.join(config.CONFIG_DIR, "base.yml"), *tb.HARNESS, *LLAMA2_7B, *(TINY if smoke else [])]
  base += [f"base_num_decoder_layers={layers}", f"per_device_batch_size={batch}", f"max_target_length={length}"]
  if smoke:  # no cuDNN on a CPU: the fp8 row with dot_product attention
    rows = {
      f"{name} (smoke: dot_product)": measure([*base, "attention=dot_product", *extra[1:]], timed)
      for name, extra in ROWS.items()
    }
  else:
    rows = {name: measure([*base, *extra], timed) for name, extra in ROWS.items()}
  cudnn, dot = (row["first loss"] for row in list(rows.values())[:2])
  agree = f"first-step loss, cuDNN flash {cudnn:.5f} vs dot_product {dot:.5f}: relative difference "
  agree += f"{abs(cudnn - dot) / abs(dot):.2e}"
  tests = "skipped (--smoke)" if smoke else gpu_tests()
  when = datetime.date.today().isoformat()
  text = "\n".join([
    f"# GPU check, {when}: {device.device_kind} x {jax.device_count()}, jax {jax.__version__}",
    "",
    f"Command: `{' '.join(['bash benchmarks/gpu_check.sh', *argv[1:]])}` ({time.perf_counter() - started:.0f} s)",
    "",
    f"GPU tests: {tests}",
    "",
    f"llama2-7b shape cut to {layers} layers, {batch} x {length} tokens per step, bfloat16, remat full, "
    f"{timed} timed steps; MFU against {accelerators.peak(dtype='bfloat16').describe()}:",
    "",
    markdown(rows),
    "",
    agree + (" (both dot_product under --smoke)" if smoke else " (bfloat16: within 2e-2 is agreement)"),
    "",
  ])  # fmt: skip
  print(text)
  out = flags.get("out", "" if smoke else os.path.join(ROOT, "benchmarks", "gpu"))
  if out:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{when}-{device.device_kind.replace(' ', '_')}.md")
    with open(path, "w") as f:
      f.write(text)
    print(f"wrote {path}")


if __name__ == "__main__":
  main(sys.argv)
