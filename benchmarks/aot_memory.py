"""Per-device memory and compile time of the real train step, compiled ahead of time for TPU topologies.

    python3 benchmarks/aot_memory.py                 # every case below (tens of minutes on 2 cores)
    python3 benchmarks/aot_memory.py llama2-7b 16b   # cases whose name contains one of these words

Each case runs `MaxText/train_compile.py` in its own process (as a user would) and the table is built
from its report: arguments (state + batch), temporaries (activations, gradients, scratch), total (what
XLA:TPU must fit in HBM), all GiB per device, and the compile time. Needs libtpu
(`DEVICE=tpu bash setup.sh`); no TPU. The cases are the issue's side-by-side cases with upstream MaxText
(same model, batch, topology and remat policy); see benchmarks/README.md for MaxText's figures.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Case(NamedTuple):
  name: str
  overrides: tuple[str, ...]


def case(name: str, *overrides: str) -> Case:
  return Case(name, overrides)


CASES = (
  case("llama2-7b v5e-256", "model_name=llama2-7b", "compile_topology=v5e-256", "per_device_batch_size=4"),
  case("llama2-7b v5e-256 b16", "model_name=llama2-7b", "compile_topology=v5e-256", "per_device_batch_size=16"),
  case(
    "llama2-7b v5e-256 dot_product",
    "model_name=llama2-7b", "compile_topology=v5e-256", "per_device_batch_size=4", "attention=dot_product",
  ),
  case(
    "16b 2 x v5e-256",
    "global_parameter_scale=16", "compile_topology=v5e-256", "compile_topology_num_slices=2",
    "per_device_batch_size=4",
  ),
  case(
    "llama3.1-70b v5p-256",
    "model_name=llama3.1-70b", "compile_topology=v5p-256", "per_device_batch_size=2", "max_target_length=4096",
  ),
  case(
    "mixtral-8x7b v5p-128",
    "model_name=mixtral-8x7b", "compile_topology=v5p-128", "per_device_batch_size=4", "max_target_length=4096",
  ),
  case(
    "deepseek3-671b v5p-1024",
    "model_name=deepseek3-671b", "compile_topology=v5p-1024", "per_device_batch_size=1", "max_target_length=4096",
  ),
  case("deepseek2-16b v5p-64", "model_name=deepseek2-16b", "compile_topology=v5p-64", "per_device_batch_size=4"),
  # DeepSeek V3.2: V3 plus the lightning indexer; MLA attends in query blocks of 512 with its top-2048 mask.
  case(
    "deepseek32-671b v5p-1024",
    "model_name=deepseek32-671b", "compile_topology=v5p-1024", "per_device_batch_size=1", "max_target_length=4096",
  ),
  # Kimi K2 (1.03T): v5p-1024 is the smallest v5p slice for fsdp alone, v5p-512 with expert parallelism.
  case(
    "kimi-k2-1t v5p-1024",
    "model_name=kimi-k2-1t", "compile_topology=v5p-1024", "per_device_batch_size=1", "max_target_length=4096",
  ),
  case(
    "kimi-k2-1t v5p-512 expert=32 capacity",
    "model_name=kimi-k2-1t", "compile_topology=v5p-512", "per_device_batch_size=1", "max_target_length=4096",
    "ici_expert_parallelism=32", "capacity_factor=1.0", "capacity_group=sequence",
  ),
  # Qwen3-Next 80B-A3B: 36 gated DeltaNet + 12 gated attention layers, 512 experts per layer.
  case(
    "qwen3-next-80b-a3b v5p-128",
    "model_name=qwen3-next-80b-a3b", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=4096",
  ),
  # GLM-4.5-Air 106B-A12B and GLM-4.5 355B-A32B: GQA with partial RoPE, sigmoid-routed MoE with a shared expert.
  case(
    "glm4.5-air-106b-a12b v5p-128",
    "model_name=glm4.5-air-106b-a12b", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=4096",
  ),
  case(
    "glm4.5-355b-a32b v5p-512",
    "model_name=glm4.5-355b-a32b", "compile_topology=v5p-512", "per_device_batch_size=1", "max_target_length=4096",
  ),
  # MiniMax M2 (229B, 62 layers of 256 experts top-8): 12 bytes per parameter of state over 64 chips.
  case(
    "minimax-m2-230b v5p-128",
    "model_name=minimax-m2-230b", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=4096",
  ),
  case(
    "minimax-m2-230b v5p-128 expert=8 capacity",
    "model_name=minimax-m2-230b", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=4096",
    "ici_expert_parallelism=8", "capacity_factor=1.0", "capacity_group=sequence",
  ),
  # OLMo 3: 3 sliding-window (4096) : 1 full layers, post-norm, q/k norms across heads; its pre-training length.
  case(
    "olmo3-7b v5p-64",
    "model_name=olmo3-7b", "compile_topology=v5p-64", "per_device_batch_size=2", "max_target_length=8192",
  ),
  case(
    "olmo3-32b v5p-128",
    "model_name=olmo3-32b", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=8192",
  ),
  # Gemma 4 31B (text): 5 sliding-window (1024) : 1 full layers, the full ones with head dim 512 and K = V.
  case(
    "gemma4-31b v5p-64",
    "model_name=gemma4-31b", "compile_topology=v5p-64", "per_device_batch_size=2", "max_target_length=4096",
  ),
  # Gemma 4 26B-A4B: the dense MLP beside 128 experts (top 8) in each of its 30 layers.
  case(
    "gemma4-26b-a4b v5p-64",
    "model_name=gemma4-26b-a4b", "compile_topology=v5p-64", "per_device_batch_size=1", "max_target_length=4096",
  ),
  # Qwen3.5-35B-A3B: 30 gated DeltaNet (separate projections) + 10 gated attention layers, 256 experts per layer.
  case(
    "qwen3.5-35b-a3b v5p-64",
    "model_name=qwen3.5-35b-a3b", "compile_topology=v5p-64", "per_device_batch_size=1", "max_target_length=4096",
  ),
  case(
    "qwen3.5-122b-a10b v5p-128",
    "model_name=qwen3.5-122b-a10b", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=4096",
  ),
  # Qwen3.5-397B-A17B: fsdp 256 alone needs 97.97G of temporaries; fsdp 8 x expert 32 with capacity fits.
  case(
    "qwen3.5-397b-a17b v5p-512 expert=32 capacity",
    "model_name=qwen3.5-397b-a17b", "compile_topology=v5p-512", "per_device_batch_size=1", "max_target_length=4096",
    "ici_expert_parallelism=32", "capacity_factor=1.0", "capacity_group=sequence",
  ),
  # Expert parallelism (docs/expert_parallelism.md): tokens move to the experts by all-to-all.
  case(
    "mixtral-8x7b v5p-128 expert=8 dropless",
    "model_name=mixtral-8x7b", "compile_topology=v5p-128", "per_device_batch_size=4", "max_target_length=4096",
    "ici_expert_parallelism=8",
  ),
  case(
    "mixtral-8x7b v5p-128 expert=8 capacity",
    "model_name=mixtral-8x7b", "compile_topology=v5p-128", "per_device_batch_size=4", "max_target_length=4096",
    "ici_expert_parallelism=8", "capacity_factor=1.25", "capacity_group=sequence",
  ),
  case(
    "deepseek3-671b v5p-1024 expert=32 capacity",
    "model_name=deepseek3-671b", "compile_topology=v5p-1024", "per_device_batch_size=1", "max_target_length=4096",
    "ici_expert_parallelism=32", "capacity_factor=1.0", "capacity_group=sequence",
  ),
  # LoRA (docs/lora.md): the same step with a frozen base and rank-16 adapters, against full fine-tuning.
  case("llama2-7b v5e-16 full", "model_name=llama2-7b", "compile_topology=v5e-16", "per_device_batch_size=1"),
  case(
    "llama2-7b v5e-16 lora rank 16",
    "model_name=llama2-7b", "compile_topology=v5e-16", "per_device_batch_size=1", "lora_rank=16",
  ),
  # Llama 4 Scout: 16384 tokens per sequence, so the RoPE layers' 8192-token chunks are two per sequence.
  case(
    "llama4-17b-16e v5p-128 expert=16 capacity",
    "model_name=llama4-17b-16e", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=16384",
    "ici_expert_parallelism=16", "capacity_factor=1.25", "capacity_group=sequence",
  ),
  # Vision-language models (docs/multimodal.md): the same step with images (sharded, scanned towers; frozen),
  # and without them for comparison.
  case(
    "gemma3-27b v5p-128 images",
    "model_name=gemma3-27b", "compile_topology=v5p-128", "per_device_batch_size=2", "max_target_length=4096",
    "use_multimodal=true", "images_per_row=2",
  ),
  case(
    "gemma3-27b v5p-128 text",
    "model_name=gemma3-27b", "compile_topology=v5p-128", "per_device_batch_size=2", "max_target_length=4096",
  ),
  case(
    "llama4-17b-16e v5p-128 expert=16 capacity images",
    "model_name=llama4-17b-16e", "compile_topology=v5p-128", "per_device_batch_size=1", "max_target_length=16384",
    "ici_expert_parallelism=16", "capacity_factor=1.25", "capacity_group=sequence", "use_multimodal=true",
    "images_per_row=4",
  ),
)  # fmt: skip

REPORT = {
  "mesh": re.compile(r"mesh (\{.*?\})"),
  "seconds": re.compile(r"in ([0-9.]+) s"),
  "args": re.compile(r"arguments ([0-9.]+) GiB"),
  "temp": re.compile(r"temporaries ([0-9.]+) GiB"),
  "total": re.compile(r"total ([0-9.]+) GiB"),
}


def run(c: Case, python: str = sys.executable) -> dict[str, str]:
  """One compile in a fresh process of `python` (any interpreter with our requirements, e.g. one with a
  newer jax and libtpu: benchmarks/aot_vs_maxtext.py): {field: text}, or the error's last line as 'error'."""
  command = [python, "MaxText/train_compile.py", "MaxText/configs/base.yml", "log_config=false", *c.overrides]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
  if result.returncode:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return {"error": lines[-1][:160] if lines else f"exit {result.returncode}"}
  found = {k: p.search(result.stdout) for k, p in REPORT.items()}
  return {k: m.group(1) if m else "?" for k, m in found.items()}


def policy(c: Case) -> str:
  given = dict(o.split("=", 1) for o in c.overrides)
  return f"{given.get('remat_policy', 'full')}, {given.get('attention', 'autoselected')}"


def select(words: list[str]) -> list[Case]:
  """The cases whose name contains one of `words` (all of them for none)."""
  return [c for c in CASES if not words or any(w in c.name for w in words)]


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first), then words that select cases."""
  if {"-h", "--help"} & set(argv[1:]):
    print(__doc__.strip())
    sys.exit(0)
  cases = select(argv[1:])
  print("| case | remat, attention | mesh (axes > 1) | args GiB | temp GiB | total GiB | compile s |")
  print("|---|---|---|---|---|---|---|")
  for c in cases:
    r = run(c)
    if "error" in r:
      print(f"| {c.name} | {policy(c)} | | | | | error: {r['error']} |", flush=True)
      continue
    mesh = ", ".join(f"{k} {v}" for k, v in ast.literal_eval(r["mesh"]).items() if v > 1)
    print(
      f"| {c.name} | {policy(c)} | {mesh} | {r['args']} | {r['temp']} | {r['total']} | {r['seconds']} |", flush=True
    )


if __name__ == "__main__":
  main(sys.argv)
