"""GRPO's sampler (docs/rl.md): completions of the current policy through the inference engine's compiled
prefill + sample and decode + sample programs, with every token's log-probability, each cut after its first EOS,
which is kept (with its log-probability) so that the update teaches the model to stop. Decoding ends as soon as
every row has sampled an EOS, or after decode_max_new_tokens.

Engine.generate would drop the EOS and its log-probability when it stops on it, and without stop tokens it runs
every step; so the loop is here, over the engine's programs (the same programs, seeds and sampled tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from MaxText import planner, sharding
from MaxText import state as state_lib
from MaxText.config import Config, serving_config
from MaxText.inference import engine as engine_lib
from MaxText.inference import tokenizer as tokenizer_lib
from MaxText.layers import lora


class Samples(NamedTuple):
  completions: list[engine_lib.Completion]  # one per prompt; tokens end with the EOS when one was sampled
  decode_steps: int  # decode steps run after the prefill (at most decode_max_new_tokens - 1)


def make_engine(config: Config, mesh: Mesh) -> engine_lib.Engine:
  """The inference engine over the decoding plan's graphdef of the plain model (under LoRA the adapters are
  folded in first: policy_for_sampling), with no parameters of its own: each step hands it the policy's."""
  decode_config = serving_config(state_lib.for_inference(config))
  graphdef = state_lib.param_spec(decode_config, mesh, planner.build(decode_config, mesh, decoding=True)).graphdef
  tokenizer = tokenizer_lib.for_decoding(config)
  return engine_lib.Engine(config, mesh, graphdef, None, tokenizer, "the GRPO policy")


def policy_for_sampling(config: Config, mesh: Mesh) -> Callable[[nnx.State], nnx.State]:
  """train state params -> the engine's: the same arrays (no copy), or under LoRA the adapters folded into the
  base kernels by one jitted program (lora.merged): a second copy of the base while the step samples."""
  if not lora.enabled(config):
    return lambda params: params
  plain = serving_config(state_lib.for_inference(config))
  shardings = state_lib.param_spec(plain, mesh, planner.build(plain, mesh, decoding=True)).shardings
  return jax.jit(functools.partial(lora.merged, config), out_shardings=shardings)


def sample(engine: engine_lib.Engine, params: nnx.State, prompts: Sequence[str], seed: int) -> Samples:
  """One completion per prompt from `params` (the engine's graphdef's, on device: no host copy), cut after its
  first EOS. Rows sample as Engine.generate(stop_tokens=()) would, step for step, with decode_sampling_*."""
  c, eos = engine.config, engine.tokenizer.eos_id
  ids = [engine.encode(p) for p in prompts]
  prefill_len, cache_len, new = engine._plan(ids, c.decode_max_new_tokens)
  options = engine_lib.sampling.SamplingParams(
    jnp.float32(c.decode_sampling_temperature), jnp.int32(c.decode_sampling_top_k),
    jnp.float32(c.decode_sampling_nucleus_p),
  )  # fmt: skip
  rng, strategy = jax.random.key(seed), c.decode_sampling_strategy
  vocab = min(c.vocab_size, engine.tokenizer.vocab_size)
  tokens, logprobs, decode_steps = [], [], 0  # [steps] arrays [B] each
  with sharding.activate(c, engine.mesh):
    prompt_tokens, lengths = engine._batch(ids, prefill_len)
    out = engine._jitted("prefill", cache_len, strategy, vocab)(params, prompt_tokens, lengths, rng, options, None)
    step_fn = engine._jitted("step", strategy, vocab)
    for i in range(new):
      pending = None
      if i + 1 < new:  # dispatched before this step's tokens are read back
        pending = step_fn(params, out.cache, out.tokens, lengths, np.int32(i + 1), rng, options)
        decode_steps += 1
      tokens.append(np.asarray(out.tokens)[: len(ids)])
      logprobs.append(np.asarray(out.logprobs)[: len(ids)])
      if pending is None or (np.stack(tokens) == eos).any(axis=0).all():  # every row has ended
        break
      out = pending
  return Samples(_cut(engine, np.stack(tokens, 1), np.stack(logprobs, 1)), decode_steps)


def _cut(engine: engine_lib.Engine, tokens: np.ndarray, logprobs: np.ndarray) -> list[engine_lib.Completion]:
  """tokens, logprobs [B, steps] -> completions cut after the first EOS (kept), text without it."""
  eos, out = engine.tokenizer.eos_id, []
  for row, logps in zip(tokens.tolist(), logprobs.tolist(), strict=True):
    n = row.index(eos) + 1 if eos in row else len(row)
    text = engine.tokenizer.decode([t for t in row[:n] if t != eos])
    out.append(engine_lib.Completion(text, row[:n], logps[:n], "eos" if eos in row else "length"))
  return out
