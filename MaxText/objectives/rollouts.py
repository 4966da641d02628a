"""GRPO's batch source (docs/rl.md): each step's prompts, completions of the current policy sampled through the
inference engine's public programs, their rewards and the batch the update trains on.

The sampler keeps every token's log-probability and cuts each completion after its first EOS, which is kept (with
its log-probability) so that the update teaches the model to stop; decoding ends as soon as every row has sampled
an EOS, or after decode_max_new_tokens. (Engine.generate drops the EOS and its log-probability when it stops on
it, and without stop tokens it runs every step; so the loop is here, over the engine's same programs, seeds and
sampled tokens.)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from MaxText import paths, planner, sharding
from MaxText import state as state_lib
from MaxText.config import Config, serving_config
from MaxText.data import files
from MaxText.errors import DataError
from MaxText.inference import engine as engine_lib
from MaxText.inference import tokenizer as tokenizer_lib
from MaxText.layers import lora
from MaxText.objectives import rewards
from MaxText.objectives.base import Fetched

ADVANTAGE_EPS = 1e-4  # (r - mean) / (std + eps): a group whose rewards are all equal gets advantage 0


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
  prefill_len, cache_len, new = engine.lengths(ids, c.decode_max_new_tokens)
  options = engine.sampling_params()
  rng, strategy = jax.random.key(seed), c.decode_sampling_strategy
  vocab = min(c.vocab_size, engine.tokenizer.vocab_size)
  tokens, logprobs, decode_steps = [], [], 0  # [steps] arrays [B] each
  with sharding.activate(c, engine.mesh):
    prompt_tokens, lengths = engine.place(ids, prefill_len)
    out = engine.program("prefill", cache_len, strategy, vocab)(params, prompt_tokens, lengths, rng, options, None)
    step_fn = engine.program("step", strategy, vocab)
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


class Prompts(NamedTuple):
  texts: list[str]  # the prompt of each row
  where: list[str]  # each row's place, for messages: "file:line" (jsonl) or "file row i" (parquet)


def read_prompts(config: Config) -> Prompts:
  """The rl_prompt_column of every row of dataset_path (.jsonl, or .parquet); DataError naming the row."""
  path, column = config.dataset_path, config.rl_prompt_column
  if not paths.isfile(path):
    raise DataError(f"dataset_path={path!r} is not a file; give a .jsonl (or .parquet) file of prompts")
  if path.endswith(".parquet"):
    texts = files.read_parquet_column(path, column)
    return _checked(path, Prompts(texts, [f"{path} row {i}" for i in range(len(texts))]))
  rows = files.jsonl_column(path, column, "set rl_prompt_column")
  texts, where = [text for _, text in rows], [f"{path}:{number}" for number, _ in rows]
  return _checked(path, Prompts(texts, where))


def _checked(path: str, prompts: Prompts) -> Prompts:
  if not prompts.texts:
    raise DataError(f"dataset_path={path!r} holds no prompts")
  for text, where in zip(*prompts, strict=True):
    if not text.strip():
      raise DataError(f"{where}: the prompt is empty; every row needs a non-empty {'prompt'!r} text")
  return prompts


def step_rows(num_prompts: int, per_step: int, step: int, seed: int) -> list[int]:
  """The dataset rows of step `step`: a fresh permutation per epoch, so any step's prompts follow from the
  step alone."""
  rows, orders = [], {}
  for i in range(step * per_step, (step + 1) * per_step):
    epoch, index = divmod(i, num_prompts)
    if epoch not in orders:
      orders[epoch] = np.random.default_rng([seed, epoch]).permutation(num_prompts)
    rows.append(int(orders[epoch][index]))
  return rows


def advantages(scores: np.ndarray, group: int) -> np.ndarray:
  """rewards [P * G] (G consecutive completions per prompt) -> (r - group mean) / (group std + eps), [P * G]."""
  r = scores.reshape(-1, group)
  return ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + ADVANTAGE_EPS)).reshape(-1)


def build_batch(prompt_ids: Sequence[list[int]], completions: Sequence[Any], adv: np.ndarray, length: int):
  """Rows prompt + completion as next-token inputs/targets [B, length]; targets_segmentation marks the
  completion's targets only (the loss mask); old_logprobs are the sampler's, at those targets."""
  b = len(completions)
  keys = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")
  batch = {k: np.zeros((b, length), np.int32) for k in keys}
  batch["old_logprobs"] = np.zeros((b, length), np.float32)
  batch["inputs_position"][:] = np.arange(length)
  for i, (p, c) in enumerate(zip(prompt_ids, completions, strict=True)):
    seq = list(p) + list(c.tokens)
    n = len(seq) - 1  # input/target pairs
    batch["inputs"][i, :n], batch["targets"][i, :n] = seq[:-1], seq[1:]
    batch["inputs_segmentation"][i, :n] = 1
    first = len(p) - 1  # the target at index len(p) - 1 is the first completion token
    batch["targets_segmentation"][i, first:n] = 1
    batch["old_logprobs"][i, first:n] = c.logprobs
  batch["advantages"] = adv.astype(np.float32)
  return batch


def to_device(batch: dict[str, np.ndarray], shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
  """Every process holds the whole rollout (the engine's tokens are replicated): each places its own shards."""
  return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx]) for k, v in batch.items()}


class Rollouts:
  """GRPO's Batches (objectives/base.py): step s takes global_batch / num_generations prompts (step_rows), samples
  num_generations completions of each with the state's params, scores them (rl_reward) and normalises the rewards
  within each prompt's group. Its state is the next step's number, as GRPO checkpoints have always held it."""

  def __init__(self, config: Config, mesh: Mesh, shardings: dict[str, NamedSharding]):
    self.config, self.shardings = config, shardings
    self.reward = rewards.load(config.rl_reward)
    self.prompts = read_prompts(config)
    self.engine = make_engine(config, mesh)
    self.prompt_ids = [self.engine.encode(p) for p in self.prompts.texts]
    self.per_step = sharding.global_batch_size(config, mesh) // config.num_generations
    self.for_sampling = policy_for_sampling(config, mesh)
    self.step: int | None = None  # None: from the first state's step

  def next(self, state: Any) -> Fetched:
    c, g = self.config, self.config.num_generations
    step = int(state.step) if self.step is None else self.step
    start = time.perf_counter()
    rows = [r for r in step_rows(len(self.prompts.texts), self.per_step, step, c.data_shuffle_seed) for _ in range(g)]
    texts = [self.prompts.texts[r] for r in rows]
    samples = sample(self.engine, self.for_sampling(state.params), texts, c.decode_seed * 1_000_003 + step)
    completions = samples.completions
    where = [self.prompts.where[r] for r in rows]
    scores = np.asarray(rewards.score(self.reward, texts, [x.text for x in completions], where), np.float32)
    ids = [self.prompt_ids[r] for r in rows]
    batch = build_batch(ids, completions, advantages(scores, g), c.max_target_length)
    lengths = np.asarray([len(x.tokens) for x in completions], np.float32)
    self.step = step + 1
    host = {"reward_mean": float(scores.mean()), "reward_std": float(scores.std()),
            "completion_length": float(lengths.mean()), "decode_steps": samples.decode_steps,
            "sample_time_s": time.perf_counter() - start}  # fmt: skip
    return Fetched(to_device(batch, self.shardings), host)

  def get_state(self) -> dict[str, int]:
    return {"step": self.step}

  def set_state(self, state: dict[str, int]) -> None:
    self.step = int(state["step"])

  def describe(self) -> list[str]:
    c = self.config
    return [f"  grpo     {len(self.prompts.texts)} prompts from {c.dataset_path}; {self.per_step} prompts x "
            f"num_generations={c.num_generations} per step; reward {c.rl_reward}"]  # fmt: skip
