"""Decode throughput of the ~110M-parameter benchmark model (train_benchmark.BENCHMARK), side by side with
Hugging Face transformers' generate() on the same weights, in the same process: a table, not a timed test.

  python3 benchmarks/decode_benchmark.py [key=value ...]     # overrides apply on top of the benchmark model

Random weights are saved as a MaxText checkpoint and exported to Hugging Face (MaxText.convert), so both
run the same float32 model. Greedy decoding of `decode_max_new_tokens` tokens after a prompt of
PROMPT_TOKENS random tokens, at batch 1 and 8; every number is from a warm (already compiled) run.
Time to first token: prompt in, first token out. Decode tokens/s: the tokens after the first, all rows.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax
import numpy as np
from train_benchmark import BENCHMARK  # beside this file: a script imports from its own directory

from MaxText import checkpointing, config, launch, sharding
from MaxText.convert import maxtext_to_hf
from MaxText.inference import Engine, engine

DECODE = ["run_name=decode_benchmark", "max_prefill_predict_length=64", "decode_max_new_tokens=64"]
PROMPT_TOKENS = 32
BATCHES = (1, 8)


def prompts(batch: int, vocab: int) -> list[list[int]]:
  return np.random.default_rng(batch).integers(3, vocab, (batch, PROMPT_TOKENS)).tolist()


def ours(eng: Engine, batch: int, new: int) -> tuple[float, float]:
  ids = prompts(batch, eng.config.vocab_size)
  eng.generate(ids, new, strategy="greedy", stop_tokens=[])  # compile
  result = eng.generate(ids, new, strategy="greedy", stop_tokens=[])
  return result.time_to_first_token_s, result.decode_tokens_per_s


def hugging_face(model, batch: int, new: int, vocab: int) -> tuple[float, float]:
  import torch  # noqa: PLC0415

  ids = torch.tensor(prompts(batch, vocab))

  def run(n):
    t0 = time.perf_counter()
    with torch.no_grad():
      model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0

  run(2)  # warm-up
  first, full = run(1), run(new)
  return first, batch * (new - 1) / (full - first)


def hf_model(c: config.Config, params, workdir: str):
  import transformers  # noqa: PLC0415

  path = os.path.join(workdir, "params")
  checkpointing.save_params(path, params)
  hf_dir = os.path.join(workdir, "hf")
  maxtext_to_hf.convert(c.replace(load_parameters_path=path), hf_dir)
  return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32").eval()


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  launch.doc_help(argv[1:], __doc__)
  c = config.load([os.path.join(config.CONFIG_DIR, "base.yml"), *BENCHMARK, *DECODE, *argv[1:]])
  mesh = sharding.create_mesh(c)
  graphdef, params, _ = engine.load_params(c, mesh)
  eng = Engine(c, mesh, graphdef, params, None, "random weights")  # no tokenizer: token ids in and out
  with tempfile.TemporaryDirectory() as workdir:
    model = hf_model(c, params, workdir)
  new = c.decode_max_new_tokens
  print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()} | jax {jax.__version__}")
  print(f"~{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.0f}M params, prompt {PROMPT_TOKENS}, {new} new tokens")
  print("| batch | ours: first token (s) | HF: first token (s) | ours: decode tok/s | HF: decode tok/s | speed-up |")
  print("|---|---|---|---|---|---|")
  for batch in BATCHES:
    ttft, tps = ours(eng, batch, new)
    hf_ttft, hf_tps = hugging_face(model, batch, new, c.vocab_size)
    print(f"| {batch} | {ttft:.3f} | {hf_ttft:.3f} | {tps:.1f} | {hf_tps:.1f} | {tps / hf_tps:.2f}x |", flush=True)


if __name__ == "__main__":
  main(sys.argv)
