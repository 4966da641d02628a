"""Write the upstream-MaxText checkpoint fixtures of MaxText/tests/maxtext_checkpoint_test.py.

Run with a Python that has upstream MaxText (`pip install maxtext`; 0.2.5 tested, in its own venv), from
the repository root:
  /path/to/mt-venv/bin/python end_to_end/cpu/make_maxtext_fixtures.py [OUT [NAME ...]]
OUT defaults to MaxText/tests/fixtures/maxtext; NAMEs (default: all of KEEP) remake only those fixtures.
For a tiny model of each family in MODELS it trains upstream's own train.py a few steps on synthetic data
(CPU), keeps the last full-state checkpoint (upstream's Linen on-disk tree: params/params/decoder/...,
opt_state, step), derives a params-only checkpoint with upstream's generate_param_only_checkpoint (its
NNX tree: decoder/.../{value}, bf16), and records upstream's logits for a fixed prompt from each with
upstream's own from_pretrained. Which layouts are kept (to stay small): KEEP, one to three per family,
plus fixtures.json (the model keys, prompt, steps and losses) and <name>.logits.npy.

  /path/to/mt-venv/bin/python end_to_end/cpu/make_maxtext_fixtures.py --check-export .venv/bin/python
checks the other direction: each fixture exported by our MaxText.convert.to_upstream (in the other layer
layout) gives upstream's from_pretrained the fixture's logits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROMPT = [1, 17, 42, 99, 5, 73, 120, 8, 64, 33, 2, 90]  # token ids < vocab_size; the logits' fixed prompt
STEPS = 3  # upstream train steps; its last checkpoint (step STEPS - 1) is kept
# The model keys, as upstream and our config both spell them (our model yml sets the rest alike).
COMMON = {
  "base_emb_dim": 16,
  "base_num_query_heads": 2,
  "base_num_kv_heads": 2,
  "base_mlp_dim": 32,
  "base_num_decoder_layers": 2,
  "head_dim": 8,
  "vocab_size": 128,
  "max_target_length": 16,
}
MLA = {
  "first_num_dense_layers": 1,
  "kv_lora_rank": 8,
  "qk_nope_head_dim": 8,
  "qk_rope_head_dim": 4,
  "v_head_dim": 8,
  "num_experts": 4,
  "num_experts_per_tok": 2,
  "base_moe_mlp_dim": 32,
}
MODELS = {
  "llama2": {"model_name": "llama2-7b", **COMMON},
  "llama3.1": {"model_name": "llama3.1-8b", **COMMON},  # upstream rotates interleaved pairs (ours: halves)
  "mistral": {"model_name": "mistral-7b", **COMMON, "rope_max_timescale": 1000000},  # upstream's (v0.2); ours: v0.1
  "qwen3": {"model_name": "qwen3-4b", **COMMON},  # query/key norms, an explicit 1/sqrt(head_dim)
  "gemma": {"model_name": "gemma-2b", **COMMON},  # norms scale x directly (ours: 1 + w)
  "gemma2": {"model_name": "gemma2-2b", **COMMON},  # each layer a local and a global sublayer
  # 5 local : 1 global, then a remainder of 2 (upstream's scanned tree: layers, layers_remainder)
  "gemma3": {"model_name": "gemma3-4b", **COMMON, "base_num_decoder_layers": 8},
  "gpt-oss": {
    "model_name": "gpt-oss-20b",
    **COMMON,
    "base_num_decoder_layers": 4,  # two (sliding-window, full) cycles
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "base_moe_mlp_dim": 32,
  },
  "llama4": {
    "model_name": "llama4-17b-16e",
    **COMMON,
    "base_num_decoder_layers": 4,  # a RoPE-less layer every 4th
    "num_experts": 4,
    "base_moe_mlp_dim": 32,
  },
  "qwen3-moe": {
    "model_name": "qwen3-30b-a3b",
    **COMMON,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "base_moe_mlp_dim": 32,
    "rope_max_timescale": 10000000,  # upstream's; ours (as Hugging Face's config): 1000000
  },
  # MLA (a query LoRA in V3, none in V2), one dense layer then one MoE layer with shared experts
  "deepseek3": {"model_name": "deepseek3-671b", **COMMON, **MLA, "q_lora_rank": 8, "shared_experts": 1},
  "deepseek2": {"model_name": "deepseek2-16b", **COMMON, **MLA, "shared_experts": 2},
  "mixtral": {
    "model_name": "mixtral-8x7b",
    **COMMON,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "base_moe_mlp_dim": 32,  # upstream wants it equal to base_mlp_dim in an all-MoE model
  },
}
# Our keys where they differ from upstream's for the same model: upstream counts gemma2's (local, global) pairs.
# Upstream's gemma3 scales queries by head_dim ** -0.5 (ours: query_pre_attn_scalar ** -0.5, 256 in the preset).
OURS = {
  "gemma2": {"base_num_decoder_layers": 2 * COMMON["base_num_decoder_layers"]},
  "gemma3": {"query_pre_attn_scalar": COMMON["head_dim"]},
  "deepseek3": {"n_routing_groups": 1, "topk_routing_group": 1},  # upstream's preset has no groups (ours: 8)
}
# Upstream's keys for its logits only. Its from_pretrained fails on deepseek3's routing bias ("Array has been
# deleted", 0.2.5): a variable its train keeps out of the params and leaves at its zero init here
# (routed_bias_update_rate 0), so the logits are those of the router without it.
LOGITS_KEYS = {"deepseek3": {"routed_bias": "false"}}
KEEP = {  # fixture name -> (model, scan_layers, "full" | "params")
  "llama2_scanned_full": ("llama2", True, "full"),
  "llama2_unrolled_params": ("llama2", False, "params"),
  "mixtral_scanned_params": ("mixtral", True, "params"),
  "mixtral_unrolled_full": ("mixtral", False, "full"),
  "llama3.1_scanned_params": ("llama3.1", True, "params"),
  "llama3.1_unrolled_full": ("llama3.1", False, "full"),
  "mistral_unrolled_full": ("mistral", False, "full"),
  "qwen3_scanned_params": ("qwen3", True, "params"),
  "qwen3_unrolled_full": ("qwen3", False, "full"),
  "gemma_unrolled_params": ("gemma", False, "params"),
  "gemma_scanned_full": ("gemma", True, "full"),
  "gemma2_scanned_params": ("gemma2", True, "params"),
  "gemma2_unrolled_full": ("gemma2", False, "full"),
  "gemma3_unrolled_params": ("gemma3", False, "params"),
  "gemma3_scanned_params": ("gemma3", True, "params"),
  "gemma3_unrolled_full": ("gemma3", False, "full"),
  "llama4_unrolled_params": ("llama4", False, "params"),
  "llama4_scanned_full": ("llama4", True, "full"),
  "gpt-oss_unrolled_params": ("gpt-oss", False, "params"),
  "gpt-oss_scanned_full": ("gpt-oss", True, "full"),
  "qwen3-moe_unrolled_full": ("qwen3-moe", False, "full"),
  "deepseek3_unrolled_full": ("deepseek3", False, "full"),
  "deepseek2_scanned_params": ("deepseek2", True, "params"),
}
# Upstream on one CPU device, float32, no distributed init, plain dot-product attention, dropless MoE.
RUNTIME = [
  "override_model_config=true",
  "hardware=cpu",
  "skip_jax_distributed_system=true",
  "attention=dot_product",
  "dtype=float32",
  "weight_dtype=float32",
  "sparse_matmul=false",
  "capacity_factor=-1",
  "per_device_batch_size=1",
  "dataset_type=synthetic",
  "async_checkpointing=false",
  "enable_checkpointing=true",
  "log_period=1",
]


def upstream_base() -> str:
  import maxtext  # noqa: PLC0415 (upstream's package: only this generator needs it)

  return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def argv(model: str, scan: bool, **extra) -> list[str]:
  keys = {**MODELS[model], "scan_layers": str(scan).lower(), **extra}
  return [upstream_base(), *RUNTIME, *(f"{k}={v}" for k, v in keys.items())]


# Upstream's train writes its rng keys as unsafe_rbg keys; its other tools must read them alike.
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DEFAULT_PRNG_IMPL": "unsafe_rbg"}


def run(module: str, args: list[str], log: str) -> str:
  env = ENV
  with open(log, "w") as f:
    subprocess.run([sys.executable, "-m", module, *args], env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
  with open(log) as f:
    return f.read()


def train(work: str, model: str, scan: bool) -> tuple[str, list[float]]:
  """Upstream train.py; returns its last full-state checkpoint (.../<step>/items) and its losses."""
  name = f"{model}_{'scanned' if scan else 'unrolled'}"
  args = argv(model, scan, run_name=name, base_output_directory=work, steps=STEPS, checkpoint_period=STEPS - 1)
  text = run("maxtext.trainers.pre_train.train", args, os.path.join(work, f"{name}.train.log"))
  losses = [float(x) for x in re.findall(r"completed step: \d+, .*?loss: ([\d.]+)", text)]
  return os.path.join(work, name, "checkpoints", str(STEPS - 1), "items"), losses


def params_only(work: str, model: str, scan: bool, full: str) -> str:
  """upstream generate_param_only_checkpoint of `full`; returns its .../0/items."""
  name = f"{model}_{'scanned' if scan else 'unrolled'}_params"
  args = argv(model, scan, run_name=name, base_output_directory=work, load_full_state_path=full, force_unroll="false")
  run("maxtext.utils.generate_param_only_checkpoint", args, os.path.join(work, f"{name}.log"))
  return os.path.join(work, name, "checkpoints", "0", "items")


LOGITS = """
import sys, numpy as np, jax.numpy as jnp
from maxtext.configs import pyconfig
from maxtext.utils import model_creation_utils
config = pyconfig.initialize([""] + sys.argv[2:])
model, mesh = model_creation_utils.from_pretrained(config)
tokens = jnp.asarray([PROMPT], jnp.int32)
positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
with mesh:
  logits = model(tokens, positions, jnp.ones_like(tokens), enable_dropout=False)
np.save(sys.argv[1], np.asarray(logits[0], np.float32))
"""


def logits(work: str, model: str, scan: bool, checkpoint: str, out: str) -> None:
  """Upstream's logits [T, V] (float32) for PROMPT from `checkpoint`, loaded as its load_parameters_path."""
  script = os.path.join(work, "logits.py")
  with open(script, "w") as f:
    f.write(LOGITS.replace("PROMPT", repr(PROMPT)))
  extra = LOGITS_KEYS.get(model, {})
  args = argv(model, scan, run_name="logits", base_output_directory=work, load_parameters_path=checkpoint, **extra)
  with open(os.path.join(work, "logits.log"), "a") as f:
    subprocess.run([sys.executable, script, out, *args], env=ENV, stdout=f, stderr=subprocess.STDOUT, check=True)


def make(out: str, names: list[str]) -> None:
  """Remake the fixtures `names` (all of KEEP when empty) under `out`."""
  import numpy as np  # noqa: PLC0415

  work = tempfile.mkdtemp(prefix="maxtext_fixtures_")
  os.makedirs(out, exist_ok=True)
  index = os.path.join(out, "fixtures.json")
  record = {"prompt": PROMPT, "models": MODELS, "ours": OURS, "fixtures": {}}
  if names and os.path.exists(index):  # remaking some: keep the others' entries
    with open(index) as f:
      record["fixtures"] = json.load(f)["fixtures"]
  for name in names or KEEP:
    model, scan, kind = KEEP[name]
    full, losses = train(work, model, scan)
    checkpoint = full if kind == "full" else params_only(work, model, scan, full)
    target = os.path.join(out, name)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(checkpoint, target)
    logits(work, model, scan, target, os.path.join(out, f"{name}.logits.npy"))
    steps = STEPS - 1 if kind == "full" else None
    record["fixtures"][name] = {"model": model, "scan_layers": scan, "kind": kind, "step": steps, "losses": losses}
    print(f"{name}: {checkpoint} -> {target}; losses {losses}; logits {np.load(target + '.logits.npy').shape}")
  with open(index, "w") as f:
    json.dump(record, f, indent=1)
  print(f"work files in {work}")


def check_exports(out: str, names: list[str], ours: str) -> None:
  """Export each fixture with our MaxText.convert.to_upstream (run by `ours`, this repository's Python) in the
  other layer layout and the fixture's dtype, and check upstream's logits from the export equal the fixture's."""
  import numpy as np  # noqa: PLC0415

  work = tempfile.mkdtemp(prefix="maxtext_exports_")
  for name in names or KEEP:
    model, scan, kind = KEEP[name]
    scan_out = not scan
    exported = os.path.join(work, name)
    keys = [f"{k}={v}" for k, v in {**MODELS[model], **OURS.get(model, {})}.items()]
    command = [ours, "-m", "MaxText.convert.to_upstream", os.path.join(ROOT, "MaxText", "configs", "base.yml")]
    command += ["run_name=export", f"base_output_directory={work}", "override_model_config=true", *keys]
    command += [f"scan_layers={str(scan_out).lower()}", f"load_parameters_path={os.path.join(out, name)}"]
    command += ["--output", exported, "--dtype", "bfloat16" if kind == "params" else "float32"]
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    with open(exported + ".log", "w") as log:
      subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    logits(work, model, scan_out, exported, exported + ".npy")
    error = float(np.abs(np.load(exported + ".npy") - np.load(os.path.join(out, f"{name}.logits.npy"))).max())
    print(f"{name}: exported with scan_layers={scan_out}; upstream's logits from it differ by {error:.2e}")
    if error > 2e-5:
      sys.exit(f"{name}: upstream's logits from our export differ from the fixture's by {error}")


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  parser = argparse.ArgumentParser(
    prog="python3 end_to_end/cpu/make_maxtext_fixtures.py",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("out", nargs="?", default=os.path.join(ROOT, "MaxText", "tests", "fixtures", "maxtext"))
  parser.add_argument("names", nargs="*", help=f"fixtures to remake, of {', '.join(KEEP)} (default: all)")
  parser.add_argument(
    "--check-export",
    metavar="OUR_PYTHON",
    help="instead of making fixtures, check that upstream reads our exports of them (OUR_PYTHON: this repository's)",
  )
  args = parser.parse_args(argv[1:])
  if set(args.names) - set(KEEP):
    parser.error(f"unknown fixtures {sorted(set(args.names) - set(KEEP))}; known: {', '.join(KEEP)}")
  if args.check_export:
    check_exports(os.path.abspath(args.out), args.names, args.check_export)
  else:
    make(os.path.abspath(args.out), args.names)


if __name__ == "__main__":
  main(sys.argv)
