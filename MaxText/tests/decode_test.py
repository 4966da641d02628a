"""Decoding: KV-cache consistency per family (full forward == prefill == step by step), sampling
strategies, the generate() API (batching, padding, stops, streaming, log-probs, no recompilation),
decode.py and its errors."""

import logging
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import checkpointing, config, decode
from MaxText.errors import ConfigError
from MaxText.inference import Engine, engine, sampling
from MaxText.tests.conftest import BASE, ROOT, family_tiers, run_processes
from MaxText.tests.helpers import DECODE_FAMILIES, DECODE_TINY, assert_cache_equals_forward


def load(*overrides):
  return config.load([BASE, *DECODE_TINY, *overrides], {})


# The fast tier: a KV cache (llama2, also quick), latent (deepseek), sliding-window (gemma3) and recurrent (qwen3_5)
# ones, and MoE; the nightly tier the others (every family's cached greedy decoding against Hugging Face's is
# decode_parity_test's, in the whole suite).
DECODE_FAST = ("llama2", "deepseek", "gemma3", "qwen3_5", "mixtral")


@pytest.mark.parametrize("family", family_tiers(sorted(DECODE_FAMILIES), DECODE_FAST, quick="llama2", reference=False))
def test_forward_equals_prefill_equals_step_by_step(family):
  assert_cache_equals_forward(*DECODE_FAMILIES[family])


def draws(logits, strategy, n=400, **kw):
  keys = jax.random.split(jax.random.key(0), n)
  fn = jax.vmap(lambda k: sampling.sample(logits, k, strategy, sampling.SamplingParams(**kw)))
  return np.asarray(fn(keys))  # [n, B]


@pytest.mark.quick
def test_top_k_never_samples_outside_the_k_most_likely():
  logits = jax.random.normal(jax.random.key(1), (3, 50)) * 3
  got = draws(logits, "topk", top_k=5, temperature=2.0)
  top = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
  for row in range(3):
    assert set(got[:, row]) <= set(top[row]) and len(set(got[:, row])) > 1


@pytest.mark.quick
def test_nucleus_never_samples_outside_the_p_mass():
  probs = np.array([[0.4, 0.25, 0.15, 0.1, 0.05, 0.05]])
  got = draws(jnp.log(jnp.asarray(probs)), "nucleus", nucleus_p=0.75)
  assert set(got[:, 0]) == {0, 1, 2}  # 0.4 + 0.25 < 0.75 <= 0.4 + 0.25 + 0.15
  composite = draws(jnp.log(jnp.asarray(probs)), "composite", nucleus_p=0.75, top_k=2)
  assert set(composite[:, 0]) == {0, 1}


def test_greedy_and_temperature_zero_are_deterministic():
  logits = jax.random.normal(jax.random.key(2), (4, 30))
  argmax = np.asarray(jnp.argmax(logits, -1))
  for strategy in ("greedy", "weighted", "nucleus", "topk", "composite"):
    temperature = 1.0 if strategy == "greedy" else 0.0
    got = draws(logits, strategy, n=20, temperature=temperature)
    assert (got == argmax).all(), strategy


@pytest.fixture(scope="module")
def tiny_engine():
  c = load("ici_fsdp_parallelism=2", "ici_data_parallelism=-1", "vocab_size=320")  # UTF-8 byte tokens
  return Engine.load(c)


def test_batched_prompts_of_different_lengths_equal_each_alone(tiny_engine):
  prompts = ["a", "hello there", "xyz!"]
  batched = tiny_engine.generate(prompts, 6, strategy="greedy", stop_tokens=[])
  for prompt, completion in zip(prompts, batched.completions):
    alone = tiny_engine.generate([prompt], 6, strategy="greedy", stop_tokens=[]).completions[0]
    assert completion.tokens == alone.tokens and len(alone.tokens) == 6
  # A prompt length in a known bucket, and another batch size on the same shards: nothing recompiles.
  tiny_engine.generate(["abcdefg"], 6, strategy="greedy")
  compiled = {key[0]: fn._cache_size() for key, fn in tiny_engine._compiled.items()}
  assert compiled == {"prefill": 2, "step": 1}  # prefill buckets 8 and 16; one decode step


def test_same_seed_same_text_and_log_probabilities(tiny_engine):
  def run(seed):
    return tiny_engine.generate(["hi", "abc"], 8, strategy="weighted", seed=seed, stop_tokens=[], logprobs=True)

  a, b, other = run(3), run(3), run(4)
  assert a.completions == b.completions and a.texts != other.texts
  ids = tiny_engine.encode("hi") + a.completions[0].tokens
  graphdef, params = tiny_engine.graphdef, tiny_engine.params
  logits = nnx.merge(graphdef, params)(jnp.asarray([ids]), jnp.arange(len(ids))[None], jnp.ones((1, len(ids)), int))
  logp = jax.nn.log_softmax(logits[0, 2:-1], axis=-1)  # predictions of the generated tokens
  want = logp[jnp.arange(8), jnp.asarray(a.completions[0].tokens)]
  np.testing.assert_allclose(a.completions[0].logprobs, want, atol=1e-5)


def test_stops_and_streaming(tiny_engine):
  first = tiny_engine.generate(["abc"], 8, stop_tokens=[]).completions[0]
  streamed = []
  out = tiny_engine.generate(["abc"], 8, stop_tokens=[first.tokens[2]], callback=lambda i, t: streamed.append((i, t)))
  c = out.completions[0]
  assert c.finish_reason == "eos" and c.tokens == first.tokens[: first.tokens.index(first.tokens[2])]
  assert streamed == [(0, t) for t in c.tokens]
  stop = tiny_engine.tokenizer.decode(first.tokens[3:5])
  if stop and stop in first.text:
    c = tiny_engine.generate(["abc"], 8, stop_tokens=[], stop_strings=[stop]).completions[0]
    assert c.finish_reason == "stop" and c.text == first.text[: first.text.find(stop)]


def test_bad_inputs_are_clear_errors(tiny_engine, tmp_path):
  with pytest.raises(ConfigError, match="max_prefill_predict_length=16"):
    tiny_engine.generate(["x" * 40])
  with pytest.raises(ConfigError, match="does not split over"):
    decode.run(load("per_device_batch_size=0.25"))  # 2 rows on 8 devices of the fsdp axis
  path = os.path.join(tmp_path, "params")
  checkpointing.save_params(path, tiny_engine.params)
  with pytest.raises(ConfigError, match="does not match this model"):
    Engine.load(load("vocab_size=320", "base_emb_dim=64", f"load_parameters_path={path}"))
  assert Engine.load(load("vocab_size=320", f"load_parameters_path={path}")).source == path


def _warnings(fn, logger=engine.log):
  """fn()'s result and the warnings `logger` logged meanwhile (the MaxText logger does not propagate to caplog)."""
  records = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: records.append(record.getMessage())
  logger.addHandler(handler)
  try:
    return fn(), records
  finally:
    logger.removeHandler(handler)


def test_a_generation_cut_short_by_max_target_length_is_said(tiny_engine):
  """max_target_length=32 holds a 4-token prompt and 28 new tokens, not 100: a warning says so and how to get all."""
  out, said = _warnings(lambda: tiny_engine.generate([[1, 2, 3, 4]], 100, stop_tokens=[]))
  assert len(out.completions[0].tokens) == 28 and out.completions[0].finish_reason == "length"
  assert len(said) == 1 and "max_target_length=32 leaves room for 28" in said[0], said
  assert "set max_target_length=104" in said[0]
  assert _warnings(lambda: tiny_engine.generate([[1, 2, 3, 4]], 28, stop_tokens=[]))[1] == []  # what fits: silent


def test_a_relative_params_path_reads_its_metadata_without_a_warning(tiny_engine, tmp_path, monkeypatch):
  """orbax reads no item metadata under a relative path: it warned "Failed to get item metadata" on every decode
  of outputs/... and saw no tree (so an int8 checkpoint there would not have been recognised as one)."""
  checkpointing.save_params(str(tmp_path / "params"), tiny_engine.params)
  monkeypatch.chdir(tmp_path)
  tree, said = _warnings(lambda: checkpointing.saved_tree("params"), logging.getLogger("absl"))
  assert isinstance(tree, dict) and "params" in tree
  assert not [m for m in said if "item metadata" in m], said


@pytest.mark.quick
def test_decode_command_line(capsys):
  argv = ["decode.py", BASE, *DECODE_TINY, "vocab_size=320", "prompt=I love to", "decode_max_new_tokens=4"]
  decode.main([*argv, "per_device_batch_size=1"])
  out = capsys.readouterr().out
  assert "random weights" in out and "Prompt: 'I love to'" in out and "Time to first token" in out
  assert "(8 rows x 3 steps)" in out


def test_decode_command_line_decodes_one_row_unless_a_batch_is_asked_for(capsys):
  decode.main(["decode.py", BASE, *DECODE_TINY, "vocab_size=320", "prompt=I love to", "decode_max_new_tokens=4"])
  assert "(1 row x 3 steps)" in capsys.readouterr().out  # not base.yml's per_device_batch_size x 8 devices


@pytest.mark.slow
def test_two_processes_decode_like_one(tmp_path):
  """decode.py as 2 processes x 4 CPU devices (jax.distributed, one global 8-device mesh) prints the
  same greedy text as one process with 8 devices."""
  args = [BASE, *DECODE_TINY, "vocab_size=320", "prompt=I love to", "per_device_batch_size=1"]
  args += ["decode_max_new_tokens=6", "hardware=cpu", "log_config=false"]
  results = run_processes([sys.executable, "MaxText/decode.py", *args], ROOT, tmp_path, "decode", 2, 4)
  for rc, log in results:
    assert rc == 0, log[-3000:]
  assert "jax.distributed: process 0 of 2" in results[0][1]
  one = decode.run(config.load(args, {}))
  assert f"Output: {one.texts[0]!r}" in results[0][1] and "(8 rows x 5 steps)" in results[0][1]
  assert "Output:" not in results[1][1]  # one process prints
