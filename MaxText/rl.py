"""GRPO: reinforcement learning with verifiable rewards (docs/rl.md).

python3 -m MaxText.rl CONFIG.yml load_parameters_path=... rl_reward=arithmetic dataset_path=prompts.jsonl

Each step: take global_batch / num_generations prompts; sample num_generations completions of each through the
inference engine (rl_sampling.py: KV cache, batched, decode_sampling_* settings, until every row sampled EOS)
with the current parameters, on device; score them with the reward (rl_rewards.py); normalise the rewards within
each prompt's group; one optimizer step (over gradient_accumulation_steps micro-batches) on the clipped
policy-ratio objective minus grpo_beta x KL to the frozen reference (the starting parameters; under LoRA the base
with the adapters off). The loss covers completion tokens only. Optimizer, shardings, checkpoints and signal
handling (a checkpoint and exit 75 on SIGTERM) are train.py's.
"""

from __future__ import annotations

import MaxText  # noqa: F401 (first: a signal during the imports below exits in one line, preemption.py)

# isort: split
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import checkpointing, launch, optimizers, paths, preemption, rl_rewards, rl_sampling, sharding, train
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.config import Config, serving_config
from MaxText.data import files
from MaxText.errors import ConfigError, DataError
from MaxText.inference import engine as engine_lib
from MaxText.layers import lora
from MaxText.parallel import plan as plan_lib
from MaxText.state import TrainState

ADVANTAGE_EPS = 1e-4  # (r - mean) / (std + eps): a group whose rewards are all equal gets advantage 0


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
      raise ConfigError(f"{key}={config[key]} is not supported by GRPO (MaxText/rl.py) yet; leave it at its default")


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
  step alone (a resumed run needs no data state)."""
  rows, orders = [], {}
  for i in range(step * per_step, (step + 1) * per_step):
    epoch, index = divmod(i, num_prompts)
    if epoch not in orders:
      orders[epoch] = np.random.default_rng([seed, epoch]).permutation(num_prompts)
    rows.append(int(orders[epoch][index]))
  return rows


class Rollout(NamedTuple):
  batch: dict[str, np.ndarray]  # the train batch's fields [B, T], old_logprobs [B, T] and advantages [B]
  rewards: np.ndarray  # [B] float32
  lengths: np.ndarray  # [B] completion tokens (with the EOS, when one was sampled)
  decode_steps: int  # decode steps the sampler ran (fewer than decode_max_new_tokens - 1 once every row ended)


def advantages(rewards: np.ndarray, group: int) -> np.ndarray:
  """rewards [P * G] (G consecutive completions per prompt) -> (r - group mean) / (group std + eps), [P * G]."""
  r = rewards.reshape(-1, group)
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


def token_logprobs(graphdef: nnx.GraphDef, config: Config, params: nnx.State, batch: dict) -> jax.Array:
  """log pi(target | prefix) [B, T] under `params` (train_step's logits, vocabulary tiling included)."""
  model = nnx.merge(graphdef, params)
  out = model.forward(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"], None, hidden_only=True)
  tiles = steps.vocab_tiles(config, *batch["targets"].shape, model.plan.data_shards)
  lse, target_logit = steps.token_logits(model, out.logits, batch["targets"], tiles)
  return target_logit - lse


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


SUM_KEYS = ("loss", "rows", "tokens", "kl", "clipped")  # what grpo_sums adds up, over micro-batches too


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


def _grads(graphdef, config: Config, partition: state_lib.Partition, trainable, frozen, reference, batch):
  """Summed gradients with respect to `trainable` (`frozen`, the rest or None, gets none) and the SUM_KEYS sums,
  over gradient_accumulation_steps micro-batches; the reference log-probs are computed per micro-batch too."""

  def objective(trainable, batch):
    ref_logp = jax.lax.stop_gradient(token_logprobs(graphdef, config, reference, batch))
    return grpo_sums(graphdef, config, partition.combine(trainable, frozen), ref_logp, batch)

  grad_fn = jax.grad(objective, has_aux=True)
  micro = config.gradient_accumulation_steps
  if micro == 1:
    return grad_fn(trainable, batch)
  data_axes = sharding.data_axes(config)

  def split(x):  # micro-batch i takes rows i, i + micro, ... (as train_step): each device holds a share of each
    x = x.reshape(-1, micro, *x.shape[1:]).swapaxes(0, 1)  # [micro, B/micro, ...]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(None, data_axes, *[None] * (x.ndim - 2)))

  def body(acc, micro_batch):
    return jax.tree.map(jnp.add, acc, grad_fn(trainable, micro_batch)), None

  zeros = (jax.tree.map(jnp.zeros_like, trainable), {k: jnp.zeros((), jnp.float32) for k in SUM_KEYS})
  acc, _ = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
  return acc


def grpo_step(
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  config: Config,
  partition: state_lib.Partition,
  state: TrainState,
  ref_params: nnx.State | None,
  batch: dict[str, jax.Array],
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step on a rollout batch; like train_step, a non-finite update is not applied. Under LoRA
  (`partition` freezes the base) only the adapters are differentiated and updated, and the reference is the base
  with the adapters off (train_step.reference_params; `ref_params` None), as DPO's."""
  trainable, frozen = partition.split(state.params)
  reference = steps.reference_params(partition, state.params, ref_params)
  grads, sums = _grads(graphdef, config, partition, trainable, frozen, reference, batch)
  grads = jax.tree.map(lambda g: g / jnp.maximum(sums["rows"], 1.0), grads)  # the mean over completions
  metrics = sums_to_metrics(sums)
  loss, grad_norm = metrics["loss"], optax.global_norm(grads)
  updates, opt_state = tx.update(grads, state.opt_state, trainable)
  params = optax.apply_updates(trainable, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & steps.all_finite((params, opt_state))
  params, opt_state = jax.tree.map(
    lambda new, old: jnp.where(finite, new, old), (params, opt_state), (trainable, state.opt_state)
  )
  metrics |= {
    "grad_norm": grad_norm,
    "learning_rate": schedule(state.step),
    "update_finite": finite.astype(jnp.float32),
  }
  params = partition.combine(params, frozen)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def batch_shardings(config: Config, mesh: Mesh) -> dict[str, NamedSharding]:
  """train_step's batch shardings plus the RL fields, all split over the data axes."""
  return {**steps.batch_shardings(config, mesh), "old_logprobs": sharding.input_sharding(config, mesh),
          "advantages": sharding.input_sharding(config, mesh, rank=1)}  # fmt: skip


def jit_grpo_step(config: Config, mesh: Mesh, optimizer: optimizers.Optimizer, spec: state_lib.StateSpec) -> Any:
  """grpo_step bound to its static arguments and jitted with shardings; the state is donated, the reference not
  (None under LoRA: the base is the reference)."""
  replicated = NamedSharding(mesh, PartitionSpec())
  reference = None if spec.partition.freezes else spec.shardings.params
  return jax.jit(
    functools.partial(grpo_step, spec.graphdef, optimizer.tx, optimizer.schedule, config, spec.partition),
    in_shardings=(spec.shardings, reference, batch_shardings(config, mesh)),
    out_shardings=(spec.shardings, replicated),
    donate_argnums=0,
    compiler_options=steps.step_compiler_options(config, mesh),
  )


def to_device(batch: dict[str, np.ndarray], shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
  """Every process holds the whole rollout (the engine's tokens are replicated): each places its own shards."""
  return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx]) for k, v in batch.items()}


@dataclasses.dataclass
class Parts:
  """What the loop needs, built once by run()."""

  mesh: Mesh
  engine: engine_lib.Engine
  step_fn: Any
  ref_params: nnx.State
  reward: rl_rewards.Reward
  prompts: list[str]
  prompt_ids: list[list[int]]
  per_step: int  # prompts per step
  manager: Any
  for_sampling: Any  # train state params -> the engine's (rl_sampling.policy_for_sampling)
  partition: state_lib.Partition  # which params train: all, or under LoRA the adapters (what checkpoints hold)
  watch: preemption.Watch | None = None  # signals: stop with a checkpoint at the next step boundary


def reference_params(config: Config, mesh: Mesh, spec: state_lib.StateSpec, restored: Any) -> nnx.State | None:
  """The frozen reference: the parameters the run started from (load_parameters_path, else the random init of
  init_weights_seed), also when resuming from a later checkpoint; a separate copy on device. None under LoRA,
  whose reference is the frozen base inside the train state (adapters off: train_step.reference_params)."""
  if spec.partition.freezes:
    return None
  if config.load_parameters_path:
    return checkpointing.load_params(config.load_parameters_path, spec.abstract.params)
  if restored.source == "init":
    return jax.tree.map(jnp.copy, restored.state.params)
  return state_lib.init_params(config, state_lib.param_spec(config, mesh, spec.plan))


def run(config: Config, devices: Sequence[Any] | None = None) -> dict[str, Any]:
  """GRPO to config.steps on `devices` (default: all); returns the last step's metrics ({} if none ran)."""
  train.check_hardware(config)
  config = train.keep_schedule_on_resume(config)  # a resume with more steps keeps the learning-rate schedule
  mesh = sharding.create_mesh(config, devices)
  check(config, sharding.global_batch_size(config, mesh))
  reward = rl_rewards.load(config.rl_reward)
  prompts = read_prompts(config)
  optimizer = optimizers.build(config)
  with sharding.activate(config, mesh), preemption.Watch(mesh) as watch:
    spec = state_lib.state_spec(config, optimizer.tx, mesh, plan_lib.build(config, mesh))
    manager = checkpointing.create_manager(config)
    try:
      restored = checkpointing.restore_or_init(config, optimizer.tx, spec, manager)
      if train.already_done(config, int(restored.state.step)):
        return {}
      engine = rl_sampling.make_engine(config, mesh)
      ids = [engine.encode(p) for p in prompts.texts]
      parts = Parts(mesh, engine, jit_grpo_step(config, mesh, optimizer, spec),
                    reference_params(config, mesh, spec, restored), reward, prompts, ids,
                    sharding.global_batch_size(config, mesh) // config.num_generations, manager,
                    rl_sampling.policy_for_sampling(config, mesh), spec.partition, watch)  # fmt: skip
      train.write_config(config)
      return loop(config, parts, restored)
    finally:  # also on a reward error: checkpoints of earlier steps complete, none is lost
      if manager is not None:
        checkpointing.finish(manager)


def rollout(config: Config, parts: Parts, params: nnx.State, step: int) -> tuple[Rollout, list[int]]:
  """Sample num_generations completions of this step's prompts with `params`, score them, build the batch."""
  g = config.num_generations
  rows = [r for r in step_rows(len(parts.prompts.texts), parts.per_step, step, config.data_shuffle_seed)
          for _ in range(g)]  # fmt: skip
  texts = [parts.prompts.texts[r] for r in rows]
  samples = rl_sampling.sample(parts.engine, parts.for_sampling(params), texts, config.decode_seed * 1_000_003 + step)
  completions = samples.completions
  where = [parts.prompts.where[r] for r in rows]
  rewards = np.asarray(rl_rewards.score(parts.reward, texts, [c.text for c in completions], where), np.float32)
  ids = [parts.prompt_ids[r] for r in rows]
  batch = build_batch(ids, completions, advantages(rewards, g), config.max_target_length)
  lengths = np.asarray([len(c.tokens) for c in completions], np.float32)
  return Rollout(batch, rewards, lengths, samples.decode_steps), rows


def loop(config: Config, parts: Parts, restored: Any) -> dict[str, Any]:
  """Steps from the restored state to config.steps: sample, score, update, log, checkpoint."""
  state, start = restored.state, int(restored.state.step)
  writer = MetricsWriter(config, jax.process_index() == 0)
  writer.header(config, parts, restored.source, start)
  shardings = batch_shardings(config, parts.mesh)
  record: dict[str, Any] = {}
  for step in range(start, config.steps):
    t0 = time.perf_counter()
    with sharding.activate(config, parts.mesh):
      out, _ = rollout(config, parts, state.params, step)
    sampled = time.perf_counter()
    state, metrics = parts.step_fn(state, parts.ref_params, to_device(out.batch, shardings))
    scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
    done = step + 1
    train.check_finite(config, done, scalars)
    record = {"step": done, **scalars, "reward_mean": float(out.rewards.mean()), "reward_std": float(out.rewards.std()),
              "completion_length": float(out.lengths.mean()), "decode_steps": out.decode_steps,
              "sample_time_s": sampled - t0, "step_time_s": time.perf_counter() - t0}  # fmt: skip
    writer.write(record)
    stop = parts.watch.stop_signal() if parts.watch else 0  # the same on every process
    if parts.manager is not None and (done % config.checkpoint_period == 0 or done == config.steps or stop):
      checkpointing.save(parts.manager, done, parts.partition.checkpointed(state), {"step": done})  # LoRA: adapters
      writer.say(f"checkpoint {done}: {train.checkpoint_path(config, done)}")
    if stop and done < config.steps:  # run() waits for the save before the exception leaves it
      path = paths.join(config.checkpoint_dir, str(done)) if parts.manager is not None else None
      raise preemption.Stopped(done, parts.watch.signum or stop, path, here=bool(parts.watch.signum))
  return record


class MetricsWriter:
  """One console line and one metrics.jsonl line per step (the writer process only)."""

  def __init__(self, config: Config, is_writer: bool):
    self.file, self.total, self.is_writer = config.metrics_file, config.steps, is_writer
    if is_writer:
      paths.makedirs(paths.dirname(self.file))

  def say(self, line: str) -> None:
    if self.is_writer:
      print(line, flush=True)

  def header(self, config: Config, parts: Parts, source: str, start: int) -> None:
    self.say(f"GRPO: {len(parts.prompts.texts)} prompts from {config.dataset_path}; {parts.per_step} prompts x "
             f"num_generations={config.num_generations} per step; reward {config.rl_reward}; start step {start} "
             f"({source}); mesh {dict(parts.mesh.shape)}")  # fmt: skip

  def write(self, record: dict[str, Any]) -> None:
    if not self.is_writer:
      return
    with paths.Path(self.file).open("a") as f:
      f.write(json.dumps(record) + "\n")
    r = record
    self.say(f"step {r['step']}/{self.total} | reward {r['reward_mean']:.3f} ± {r['reward_std']:.3f} | "
             f"len {r['completion_length']:.1f} | loss {r['loss']:.4f} | kl {r['kl']:.5f} | "
             f"clip {r['clip_fraction']:.3f} | grad {r['grad_norm']:.3f} | {r['step_time_s']:.2f} s")  # fmt: skip


def compile_steps(config: Config) -> dict[str, Any]:
  """AOT (compile_topology): compile the GRPO update and the engine's prefill + sample and decode + sample
  programs for the topology's devices with shaped inputs only; {name: train_compile.CompileReport}. The update's
  arguments hold the train state and the reference parameters (a second copy of the params)."""
  from MaxText import train_compile  # lazy: AOT only

  devices = train_compile.topology_devices(config)
  mesh = sharding.create_mesh(config, devices)
  check(config, sharding.global_batch_size(config, mesh))
  optimizer, plan = optimizers.build(config), plan_lib.build(config, mesh)
  lines = tuple(plan_lib.describe(plan, config))
  reports = {}
  with sharding.activate(config, mesh):
    spec = state_lib.state_spec(config, optimizer.tx, mesh, plan)
    batch, _ = train_compile.shaped_inputs(config, mesh)
    shardings = batch_shardings(config, mesh)
    b, t = batch["inputs"].shape
    batch["old_logprobs"] = jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=shardings["old_logprobs"])
    batch["advantages"] = jax.ShapeDtypeStruct((b,), jnp.float32, sharding=shardings["advantages"])
    start = time.perf_counter()
    reference = None if spec.partition.freezes else spec.abstract.params  # LoRA: the base in the state
    compiled = jit_grpo_step(config, mesh, optimizer, spec).lower(spec.abstract, reference, batch).compile()
    reports["grpo_step"] = train_compile._report(compiled, devices, mesh, time.perf_counter() - start, lines)
    reports.update(_compile_sampling(config, mesh, devices, spec.abstract.params, b))
  return reports


def reference_bytes(config: Config) -> int:
  """Bytes per device of the frozen reference's parameters (as sharded on the compile topology's mesh)."""
  from MaxText import train_compile  # lazy: AOT only

  if lora.enabled(config):  # the reference is the frozen base inside the train state
    return 0
  mesh = sharding.create_mesh(config, train_compile.topology_devices(config))
  with sharding.activate(config, mesh):
    abstract = state_lib.param_spec(config, mesh).abstract
  leaves = jax.tree.leaves(abstract)
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


def _compile_sampling(
  config: Config, mesh: Mesh, devices: Sequence[Any], abstract_params: Any, b: int
) -> dict[str, Any]:
  """The engine's two programs at this config's prompt bucket and cache length, on the train state's params
  (under LoRA the merged ones: the plain model's)."""
  from MaxText import train_compile  # lazy: AOT only

  engine = rl_sampling.make_engine(config, mesh)
  if lora.enabled(config):
    plain = serving_config(state_lib.for_inference(config))
    abstract_params = state_lib.param_spec(plain, mesh, plan_lib.build(plain, mesh, decoding=True)).abstract
  prompt = engine_lib.bucket(config.max_prefill_predict_length, config.max_prefill_predict_length)
  cache_len = max(engine_lib.bucket(prompt + config.decode_max_new_tokens, config.max_target_length), prompt)
  vocab = config.vocab_size
  strategy = config.decode_sampling_strategy
  rows = lambda rank: sharding.input_sharding(config, mesh, rank=rank)  # noqa: E731
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, PartitionSpec()))  # noqa: E731
  params = engine_lib.sampling.SamplingParams(scalar(jnp.float32), scalar(jnp.int32), scalar(jnp.float32))
  tokens = jax.ShapeDtypeStruct((b, prompt), jnp.int32, sharding=rows(2))
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows(1))
  start = time.perf_counter()
  prefill = engine._jitted("prefill", cache_len, strategy, vocab)
  compiled = prefill.lower(abstract_params, tokens, lengths, key, params).compile()
  reports = {"sample_prefill": train_compile._report(compiled, devices, mesh, time.perf_counter() - start, ())}
  out = compiled.output_shardings.cache if hasattr(compiled.output_shardings, "cache") else None
  cache = jax.eval_shape(prefill, abstract_params, tokens, lengths, key, params).cache
  if out is not None:
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, out)
  start = time.perf_counter()
  index = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
  step = engine._jitted("step", strategy, vocab).lower(abstract_params, cache, lengths, lengths, index, key, params)
  reports["sample_step"] = train_compile._report(step.compile(), devices, mesh, time.perf_counter() - start, ())
  return reports


USAGE = launch.Usage(
  command="python3 -m MaxText.rl CONFIG.yml load_parameters_path=PARAMS rl_reward=NAME dataset_path=prompts.jsonl",
  summary="GRPO: sample num_generations completions per prompt, reward them, update with the clipped ratio + KL.",
  keys=("load_parameters_path", "rl_reward", "dataset_path", "rl_prompt_column", "num_generations", "grpo_beta",
        "grpo_epsilon", "decode_max_new_tokens", "decode_sampling_strategy", "decode_sampling_temperature",
        "per_device_batch_size", "steps", "learning_rate", "checkpoint_period"),
)  # fmt: skip


def config_compiles(argv: Sequence[str]) -> bool:
  """Whether the command line asks for AOT compilation (no job to join, no devices of the target needed)."""
  return any(a.startswith("compile_topology=") and a != "compile_topology=" for a in argv)


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  config = launch.start(argv[1:], USAGE, join_job=not config_compiles(argv))
  with launch.user_errors(), preemption.lost_processes(config.checkpoint_dir if config.enable_checkpointing else None):
    if config.compile_topology:
      from MaxText import train_compile  # lazy: AOT only

      for name, report in compile_steps(config).items():
        print(f"{name}: {train_compile.format_report(report)}", flush=True)
      print(f"of grpo_step's arguments, the reference params: {reference_bytes(config) / 2**30:.2f} GiB per device")
      return
    launch.check_outputs(config)
    try:
      run(config)  # raises Stopped after its checkpoint
    except preemption.Stopped as stopped:
      print(stopped.line(), file=sys.stderr, flush=True)
      sys.exit(preemption.EXIT_STOPPED)
    except rl_rewards.RewardError as e:
      sys.exit(f"Reward error: {e} (checkpoints saved before this step are kept)")
    except train.NonFiniteLossError as e:
      sys.exit(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
  main(sys.argv)
