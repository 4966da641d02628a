"""Greedy decoding against Hugging Face transformers: for the committed tiny random HF model of each family
(hf_references/), converted with MaxText.convert, 16 greedy tokens for prompts of different lengths batched
together equal the committed `generate(do_sample=False)` tokens (HF left-pads; we right-pad: both must equal
each prompt alone)."""

import json
import os

import numpy as np
import pytest

from MaxText import config
from MaxText.convert import hf_to_maxtext
from MaxText.inference import Engine
from MaxText.tests.conftest import family_tiers
from MaxText.tests.helpers import HF_DECODE, PARITY_NEW, PROMPTS, hf_model

# One per attention/layer variant: GQA, projection biases, sliding window, MoE, q/k norms, gemma norms,
# soft-caps with local/global layers, 5:1 local/global, multi-head latent attention (V3; V2 with YaRN; Kimi K2's
# YaRN with beta_fast = beta_slow), learned positions, chunked local / NoPE global layers with input-weighted
# top-1 MoE (llama4), post-norm layers with q/k norms across heads and YaRN on full layers only (olmo3), partial
# RoPE with q/k norms across heads and sigmoid + bias routing in every layer (minimax-m2), MLA with the lightning
# indexer over its cached keys (deepseek32), full layers of their own shape with K = V and proportional RoPE between
# sliding ones (gemma4), with kv-sharing layers and per-layer embeddings (gemma4-ple).
FAMILIES = ["llama2", "llama-bias", "mistral", "mixtral", "qwen3", "gemma", "gemma2", "gemma3", "deepseek3"]
FAMILIES += ["deepseek2", "kimi-k2", "gpt3", "llama4", "olmo3"]
FAMILIES += ["glm4_moe", "minimax-m2"]
FAMILIES += ["deepseek32"]
FAMILIES += ["qwen3.5"]  # the hybrid DeltaNet / gated-attention stack, dense: recurrent state and KV caches
FAMILIES += ["gemma4", "gemma4-ple"]
FAMILIES += ["gemma4-moe"]  # the MoE block beside each dense MLP


# The fast tier: GQA, MoE, 5:1 local/global and multi-head latent attention; the slow tier every family.
@pytest.mark.parametrize("family", family_tiers(FAMILIES, ("llama2", "mixtral", "gemma3", "deepseek3")))
def test_greedy_tokens_equal_hugging_face_generate(family, tmp_path):
  reference, hf_path = hf_model(family, tmp_path)
  if family in HF_DECODE:  # the settings the reference's greedy tokens were made with (helpers.HF_DECODE)
    path = os.path.join(hf_path, "config.json")
    json.dump({**json.load(open(path)), **HF_DECODE[family]}, open(path, "w"))
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out)
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={out}/params"]
    + ["max_target_length=32", "max_prefill_predict_length=16", "ici_fsdp_parallelism=1", "ici_data_parallelism=-1"],
    {},
  )
  got = Engine.load(c).generate(PROMPTS, PARITY_NEW, strategy="greedy", stop_tokens=[])
  want = reference.greedy
  for row, completion in enumerate(got.completions):
    np.testing.assert_array_equal(completion.tokens, want[row], err_msg=f"prompt {row}")
