"""Peak host memory and time of hf_to_maxtext and maxtext_to_hf on a synthetic Llama checkpoint.

    python3 benchmarks/convert_benchmark.py --layers 24 --emb 1024 --mlp 4096 [--scan_layers false]

Writes a random Llama-architecture Hugging Face directory (config.json + two safetensors shards, float32)
to a scratch directory, converts it to MaxText and back, each in a child process, and prints a table:
model size, largest single tensor, the child's peak resident memory (VmHWM) before the conversion
(imports, config) and at its end, the growth between the two, and the wall time. Both converters
stream, so their growth should stay near a few of the largest tensors (or one layer), far below the
model size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

CHILD = """
import json, sys, time
import jax
jax.config.update("jax_platforms", "cpu")
from MaxText import config as config_lib
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
import ml_dtypes, safetensors.numpy  # the export's writer, imported before the baseline
direction, src, dst, scan = sys.argv[1:5]
def peak_kb():  # this process image's peak RSS (unlike ru_maxrss, not inherited from the parent)
  return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
if direction == "export":
  argv = [src + "/config.yml", f"load_parameters_path={src}/params", "run_name=export", "dtype=float32"]
  c = config_lib.load(argv, {})
before = peak_kb()
start = time.perf_counter()
if direction == "import":
  hf_to_maxtext.convert(src, dst, scan_layers=scan == "true")
else:
  maxtext_to_hf.convert(c, dst)
seconds = time.perf_counter() - start
print(json.dumps({"before_kb": before, "after_kb": peak_kb(), "seconds": seconds}))
"""


def write_llama(path: str, layers: int, emb: int, mlp: int, vocab: int, heads: int) -> tuple[int, int]:
  """A random Llama checkpoint in two safetensors shards; returns (total bytes, largest tensor bytes)."""
  from safetensors.numpy import save_file  # noqa: PLC0415

  os.makedirs(path, exist_ok=True)
  config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=emb, intermediate_size=mlp)
  config |= dict(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab)
  config |= dict(hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  rng = np.random.default_rng(0)
  total, largest = 0, 0

  def tensor(*shape):
    nonlocal total, largest
    a = rng.standard_normal(shape, dtype=np.float32) * 0.02
    total, largest = total + a.nbytes, max(largest, a.nbytes)
    return a

  shards = [{"model.embed_tokens.weight": tensor(vocab, emb), "model.norm.weight": tensor(emb)}, {}]
  shards[1]["lm_head.weight"] = tensor(vocab, emb)
  for i in range(layers):
    shard = shards[i * 2 // layers]
    p = f"model.layers.{i}."
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      shard[p + f"self_attn.{name}.weight"] = tensor(emb, emb)
    shard[p + "mlp.gate_proj.weight"], shard[p + "mlp.up_proj.weight"] = tensor(mlp, emb), tensor(mlp, emb)
    shard[p + "mlp.down_proj.weight"] = tensor(emb, mlp)
    shard[p + "input_layernorm.weight"], shard[p + "post_attention_layernorm.weight"] = tensor(emb), tensor(emb)
  for i, shard in enumerate(shards):
    save_file(shard, os.path.join(path, f"model-{i:05d}-of-00002.safetensors"))
  return total, largest


def measure(src: str, dst: str, scan_layers: bool, direction: str = "import") -> dict:
  """hf_to_maxtext (direction import: src = HF dir) or maxtext_to_hf (export: src = hf_to_maxtext's
  output dir) in a child process; its peak RSS before/after and the time."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root}
  argv = [sys.executable, "-c", CHILD, direction, src, dst, str(scan_layers).lower()]
  proc = subprocess.run(argv, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"conversion failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  parser = argparse.ArgumentParser(
    prog="python3 benchmarks/convert_benchmark.py",
    epilog="More: benchmarks/README.md in the repository.",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--emb", type=int, default=1024)
  parser.add_argument("--mlp", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--scan_layers", default="true", choices=("true", "false"))
  parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
  args = parser.parse_args(argv[1:])
  with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
    hf, out = os.path.join(tmp, "hf"), os.path.join(tmp, "out")
    total, largest = write_llama(hf, args.layers, args.emb, args.mlp, args.vocab, args.heads)
    rows = [("import (hf_to_maxtext)", measure(hf, out, args.scan_layers == "true"))]
    rows.append(("export (maxtext_to_hf)", measure(out, os.path.join(tmp, "back"), False, "export")))
  gb = 1 / 2**30
  print(
    "| direction | model (GB) | largest tensor (GB) | scan_layers | peak RSS before (GB) | peak RSS after (GB) "
    "| growth (GB) | growth / model | time (s) |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for direction, r in rows:
    before, after = r["before_kb"] * 1024 * gb, r["after_kb"] * 1024 * gb
    print(
      f"| {direction} | {total * gb:.2f} | {largest * gb:.3f} | {args.scan_layers} | {before:.2f} | {after:.2f} | "
      f"{after - before:.2f} | {(after - before) / (total * gb):.2f} | {r['seconds']:.1f} |"
    )


if __name__ == "__main__":
  main(sys.argv)
