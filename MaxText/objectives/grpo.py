"""GRPO (objective=grpo; python3 -m MaxText.rl): reinforcement learning with verifiable rewards (docs/rl.md).

Each step: take global_batch / num_generations prompts; sample num_generations completions of each through the
inference engine (objectives/rollouts.py: KV cache, batched, decode_sampling_* settings, until every row sampled
EOS) with the current parameters, on device; score them with the reward (objectives/rewards.py); normalise the
rewards within each prompt's group; one optimizer step (over gradient_accumulation_steps micro-batches) on the
clipped policy-ratio objective minus grpo_beta x KL to the frozen reference (the starting parameters; under LoRA
the base with the adapters off). The loss covers completion tokens only. Everything else (optimizer, shardings,
checkpoints, signals, goodput, metrics) is the trainer's.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import planner, sharding
from MaxText import state as state_lib
from MaxText.config import Config, serving_config
from MaxText.errors import ConfigError
from MaxText.inference import engine as engine_lib
from MaxText.layers import lora
from MaxText.objectives import lm, rollouts
from MaxText.objectives.base import Batch, Field, Sources, Sums, target_logps

SUM_KEYS = ("loss", "rows", "tokens", "kl", "clipped")  # what grpo_sums adds up, over micro-batches too


def check(config: Config, global_batch: int) -> None:
  """ConfigError naming the key, for settings GRPO cannot run with (before anything compiles)."""
  g = config.num_generations
  if g < 2:
    raise ConfigError(f"num_generations={g}: GRPO compares completions within a group; set it to 2 or more")
  if global_batch % g:
    raise ConfigError(
      f"the global batch ({global_batch} completions: per_device_batch_size x devices) is not a multiple of "
      f"num_generations={g}; change per_device_batch_size or num_generations"
    )
  if config.decode_sampling_strategy == "greedy" or config.decode_sampling_temperature <= 0:
    raise ConfigError(
      "greedy sampling gives every completion of a prompt the same text: set decode_sampling_strategy=weighted "
      "(or topk/nucleus/composite) and decode_sampling_temperature > 0"
    )
  if not config.dataset_path:
    raise ConfigError("GRPO reads its prompts from dataset_path (a .jsonl or .parquet file with a prompt column)")
  if config.grpo_epsilon <= 0 or config.grpo_beta < 0:
    raise ConfigError(f"grpo_epsilon={config.grpo_epsilon} must be > 0 and grpo_beta={config.grpo_beta} >= 0")
  for key, bad in (("use_sft", config.use_sft), ("mtp_num_layers", config.mtp_num_layers > 0)):
    if bad:
      raise ConfigError(f"{key}={config[key]} is not supported by GRPO (objective=grpo) yet; leave it at its default")


def token_logprobs(graphdef: nnx.GraphDef, config: Config, params: nnx.State, batch: Batch) -> jax.Array:
  """log pi(target | prefix) [B, T] under `params` (the LM loss's logits, vocabulary tiling included)."""
  return target_logps(graphdef, config, params, batch, None)


def grpo_sums(graphdef, config: Config, params, ref_logp, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The GRPO objective summed over the batch's completions (to minimise) and the sums its metrics come from
  (SUM_KEYS). Per token t of completion i: ratio = pi / pi_old;
  min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i) - beta * KL_k3(pi || pi_ref), with
  KL_k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0); averaged over each completion's tokens, then
  summed over completions: the step divides by the global batch's completions once, so micro-batches add up."""
  logp = token_logprobs(graphdef, config, params, batch)
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)  # [B, T]: completion targets only
  adv = batch["advantages"][:, None]
  ratio = jnp.exp(logp - batch["old_logprobs"])
  eps = config.grpo_epsilon
  surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps, 1 + eps) * adv)
  log_ref_ratio = ref_logp - logp
  kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1
  per_token = -(surrogate - config.grpo_beta * kl)
  per_row = jnp.maximum(mask.sum(axis=1), 1.0)
  objective = ((per_token * mask).sum(axis=1) / per_row).sum()
  clipped = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
  sums = {"loss": objective, "rows": jnp.float32(mask.shape[0]), "tokens": mask.sum(), "kl": (kl * mask).sum(),
          "clipped": (clipped * mask).sum()}  # fmt: skip
  return objective, sums


def sums_to_metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The mean loss per completion and the per-token kl and clip_fraction of grpo_sums' sums."""
  tokens = jnp.maximum(sums["tokens"], 1.0)
  return {"loss": sums["loss"] / jnp.maximum(sums["rows"], 1.0), "kl": sums["kl"] / tokens,
          "clip_fraction": sums["clipped"] / tokens}  # fmt: skip


def grpo_loss(graphdef, config: Config, params, ref_logp, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The GRPO loss of one batch (grpo_sums' objective over its completions) and its kl and clip_fraction."""
  _, sums = grpo_sums(graphdef, config, params, ref_logp, batch)
  metrics = sums_to_metrics(sums)
  return metrics.pop("loss"), metrics


class GRPO:
  """objective=grpo: the clipped policy-ratio loss minus grpo_beta x KL, the mean over the step's completions."""

  name = "grpo"
  reference = True
  perplexity = False
  denominator = "rows"  # completions

  def fields(self, config: Config) -> dict[str, Field]:
    """The token batch plus the sampler's log-probabilities [B, T] and each completion's advantage [B]."""
    return {**lm.token_fields(config), "old_logprobs": Field(2, np.float32), "advantages": Field(1, np.float32)}

  def sum_keys(self, config: Config) -> tuple[str, ...]:
    return SUM_KEYS

  def loss_sums(self, graphdef, config, params, batch, rng, reference, step=None):
    """The reference's log-probs come with each micro-batch; no dropout (rng unused)."""
    del rng, step
    ref_logp = jax.lax.stop_gradient(token_logprobs(graphdef, config, reference, batch))
    return grpo_sums(graphdef, config, params, ref_logp, batch)

  def step_metrics(self, config: Config, sums: Sums, denominator: jax.Array) -> dict[str, jax.Array]:
    return {**sums_to_metrics(sums), "tokens": sums["tokens"]}

  def eval_sums(self, graphdef, config, params, batch, reference) -> Sums:
    return self.loss_sums(graphdef, config, params, batch, None, reference)[1]

  def eval_metrics(self, config: Config, totals: dict[str, float]) -> dict[str, float]:
    return {"eval_loss": totals.get("loss", 0.0) / max(totals.get("rows", 0.0), 1.0)}

  def sources(self, config: Config, mesh: Mesh) -> Sources:
    shardings = {k: sharding.input_sharding(config, mesh, rank=f.rank) for k, f in self.fields(config).items()}
    return Sources(rollouts.Rollouts(config, mesh, shardings), None)  # no held-out prompts

  def check(self, config: Config, global_batch: int) -> None:
    check(config, global_batch)

  def aot_programs(self, config: Config, mesh: Mesh, abstract_params: Any, rows: int) -> dict[str, Any]:
    """For compile_topology: the sampler's two programs, compiled on shapes only."""
    return sampling_programs(config, mesh, abstract_params, rows)

  def aot_notes(self, config: Config, devices: Any) -> list[str]:
    gib = reference_bytes(config, devices) / 2**30
    return [f"of the train step's arguments, the reference params: {gib:.2f} GiB per device"]


def reference_bytes(config: Config, devices: Any) -> int:
  """Bytes per device of the frozen reference's parameters (as sharded on the compile topology's mesh)."""
  if lora.enabled(config):  # the reference is the frozen base inside the train state
    return 0
  mesh = sharding.create_mesh(config, devices)
  with sharding.activate(config, mesh):
    abstract = state_lib.param_spec(config, mesh).abstract
  leaves = jax.tree.leaves(abstract)
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


def sampling_programs(config: Config, mesh: Mesh, abstract_params: Any, b: int) -> dict[str, tuple[Any, float]]:
  """The engine's prefill + sample and decode + sample programs at this config's prompt bucket and cache length,
  compiled on the train state's params (under LoRA the merged ones: the plain model's): {name: (compiled,
  seconds)}."""
  engine = rollouts.make_engine(config, mesh)
  if lora.enabled(config):
    plain = serving_config(state_lib.for_inference(config))
    abstract_params = state_lib.param_spec(plain, mesh, planner.build(plain, mesh, decoding=True)).abstract
  prompt = engine_lib.bucket(config.max_prefill_predict_length, config.max_prefill_predict_length)
  cache_len = max(engine_lib.bucket(prompt + config.decode_max_new_tokens, config.max_target_length), prompt)
  strategy, vocab = config.decode_sampling_strategy, config.vocab_size
  rows = lambda rank: sharding.input_sharding(config, mesh, rank=rank)  # noqa: E731
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, PartitionSpec()))  # noqa: E731
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  params = engine_lib.sampling.SamplingParams(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32))
  tokens = jax.ShapeDtypeStruct((b, prompt), jnp.int32, sharding=rows(2))
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows(1))
  start = time.perf_counter()
  prefill = engine.program("prefill", cache_len, strategy, vocab)
  compiled = prefill.lower(abstract_params, tokens, lengths, key, params).compile()
  programs = {"sample_prefill": (compiled, time.perf_counter() - start)}
  out = compiled.output_shardings.cache if hasattr(compiled.output_shardings, "cache") else None
  cache = jax.eval_shape(prefill, abstract_params, tokens, lengths, key, params).cache
  if out is not None:
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, out)
  start = time.perf_counter()
  step = engine.program("step", strategy, vocab)
  step = step.lower(abstract_params, cache, lengths, lengths, scalar(jnp.int32), key, params).compile()
  programs["sample_step"] = (step, time.perf_counter() - start)
  return programs


OBJECTIVE = GRPO()
