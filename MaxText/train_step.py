"""The jitted steps of every objective: pure, module-level `(state, batch, rng) -> (state, metrics)` once their
static arguments (graphdef, optimizer, learning-rate schedule, config) are bound with functools.partial. The
objective (objectives.get(config): its loss sums, denominator and metrics) is the only thing that differs.
train.py, train_compile.py, tests and benchmarks all use these same functions.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import hlo_dump, objectives, optimizers, sharding
from MaxText.config import Config
from MaxText.objectives.base import Batch, Objective
from MaxText.parallel.plan import Plan
from MaxText.state import TRAIN_ALL, Partition, StateSpec, TrainState


def reference_params(partition: Partition, params: nnx.State, reference: nnx.State | None) -> nnx.State:
  """The reference model's params of an objective with one (DPO, GRPO): TrainState.reference (the frozen starting
  params), or under LoRA, which keeps none, `params` with every adapter zeroed: the frozen base alone, with no
  second copy of it."""
  if reference is not None:
    return reference
  trainable, frozen = partition.split(params)
  return partition.combine(jax.tree.map(jnp.zeros_like, trainable), frozen)


def sum_zeros(config: Config, objective: Objective) -> dict[str, jax.Array]:
  """Zero sums with the keys the objective's loss_sums add up for `config`: the start of gradient accumulation."""
  return {k: jnp.zeros((), jnp.float32) for k in objective.sum_keys(config)}


def _grads(graphdef, config, partition, params, frozen, batch, rng, data_axes, reference=None, step=None):
  """Summed gradients with respect to `params` (the trainable part of `partition`; `frozen`, the rest or
  None, gets none) and the objective's loss sums, over gradient_accumulation_steps micro-batches; `reference`:
  the frozen reference params of an objective that has one (reference_params); `step`: TrainState.step, for a
  loss that changes over the run (distill's alpha schedule)."""
  objective = objectives.get(config)

  def loss(trainable, batch, rng):
    return objective.loss_sums(graphdef, config, partition.combine(trainable, frozen), batch, rng, reference, step)

  grad_fn = jax.grad(loss, has_aux=True)
  micro = config.gradient_accumulation_steps
  if micro == 1:
    return grad_fn(params, batch, rng)

  # Micro-batch i takes rows i, i+micro, ... so that every device holds a share of each micro-batch.
  def split(x):
    x = x.reshape(-1, micro, *x.shape[1:]).swapaxes(0, 1)  # [micro, B/micro, ...]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(None, data_axes, *[None] * (x.ndim - 2)))

  def body(acc, inputs):
    micro_batch, index = inputs
    micro_rng = None if rng is None else jax.random.fold_in(rng, index)
    grads, aux = grad_fn(params, micro_batch, micro_rng)
    return jax.tree.map(jnp.add, acc, (grads, aux)), None

  micro_batches = jax.tree.map(split, batch)
  aux = sum_zeros(config, objective)
  if config.routed_bias_update_rate > 0:  # the expert loads' shapes, from the model traced on one micro-batch
    first = jax.tree.map(lambda x: x[0], micro_batches)
    loads = jax.eval_shape(grad_fn, params, first, rng)[1]["expert_load"]
    aux["expert_load"] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), loads)
  acc, _ = jax.lax.scan(body, (jax.tree.map(jnp.zeros_like, params), aux), (micro_batches, jnp.arange(micro)))
  return acc


def balance_router_bias(params: nnx.State, loads: dict[str, Any], rate: float) -> nnx.State:
  """DeepSeek V3's auxiliary-loss-free balancing: every router gate_bias [..., E] moves by rate * sign(mean load -
  load) per expert, up for the underloaded, down for the overloaded; `loads` (DecoderOutput.expert_load, summed
  over the step's micro-batches) holds each one's counts at its path with `expert_load` for `gate_bias`. The
  bias only chooses experts (no gradient reaches it) and the optimizer leaves it alone (optimizers.build)."""
  counts = {optimizers.param_path(path): load for path, load in jax.tree_util.tree_leaves_with_path(loads)}

  def update(path: Any, value: jax.Array) -> jax.Array:
    name = optimizers.param_path(path)
    if not name.endswith("gate_bias"):
      return value
    load = counts[name.removesuffix("gate_bias") + "expert_load"].astype(jnp.float32)  # [..., E]
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return value + (rate * jnp.sign(mean - load)).astype(value.dtype)

  return jax.tree_util.tree_map_with_path(update, params)


def all_finite(tree: Any) -> jax.Array:
  """bool scalar: every floating-point value in `tree` is finite (integer leaves, e.g. counters, pass)."""
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


def lane_friendly(grads: nnx.State, params: nnx.State, plan: Plan) -> nnx.State:
  """grads with sharding.keep_lanes's layout constraint where the plan keeps lanes (TPU targets; elsewhere
  unchanged); `params` holds the matching jax.ShapeDtypeStruct leaves with their shardings."""
  if not plan.keep_lanes:
    return grads

  def constrain(grad: jax.Array, param: jax.ShapeDtypeStruct) -> jax.Array:
    named = param.sharding
    return sharding.keep_lanes(grad, named) if isinstance(named, NamedSharding) else grad

  return jax.tree.map(constrain, grads, params)


def train_step(
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  config: Config,
  state: TrainState,
  batch: Batch,
  rng: jax.Array,
  *,
  abstract_params: nnx.State | None = None,
  plan: Plan | None = None,
  partition: Partition = TRAIN_ALL,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step of config.objective on the global batch; metrics are device scalars. `schedule` is the
  one that drives `tx` (optimizers.build), evaluated here only to log this step's learning rate.

  An update is applied only when the loss, the gradients and the new parameters and optimizer state are
  all finite: otherwise params and opt_state stay as they were (step still advances, so the data order
  and checkpoint numbering do not shift), metrics["update_finite"] is 0 and metrics["step_skipped"] 1.
  Checking the result, not just the loss, catches an overflow one step before it reaches the loss.
  `abstract_params` (StateSpec.abstract.params: shapes and shardings) and the run `plan` let TPU gradients take
  sharding.lane_layout. `partition` (StateSpec.partition) says which parameters train: by default all."""
  objective = objectives.get(config)
  # Under LoRA only the adapters are differentiated and updated; the frozen base passes through untouched.
  trainable, frozen = partition.split(state.params)
  reference = reference_params(partition, state.params, state.reference) if objective.reference else None
  data_axes = sharding.data_axes(config)
  grads, sums = _grads(graphdef, config, partition, trainable, frozen, batch, rng, data_axes, reference, state.step)
  if abstract_params is not None and plan is not None:
    grads = lane_friendly(grads, partition.trainable(abstract_params), plan)
  denominator = jnp.maximum(sums[objective.denominator], 1.0)  # tokens, pairs or completions of the global batch
  grads = jax.tree.map(lambda g: g / denominator, grads)
  metrics = objective.step_metrics(config, sums, denominator)
  loss, grad_norm = metrics["loss"], optax.global_norm(grads)
  params, opt_state, finite = _update(config, tx, state, trainable, grads, sums, loss, grad_norm)
  params = partition.combine(params, frozen)
  spiked = opt_state.skipped if config.skip_step_on_spikes else jnp.array(False)
  metrics |= {
    "grad_norm": grad_norm,
    "param_norm": optax.global_norm(params),
    "learning_rate": schedule(state.step),
    "update_finite": finite.astype(jnp.float32),
    "step_skipped": (~finite | spiked).astype(jnp.float32),
  }
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _update(config: Config, tx, state: TrainState, trainable, grads, sums, loss, grad_norm):
  """(params, opt_state, finite): the optimizer's update of `trainable`, kept only where everything is finite."""
  extra = {"loss": loss, "grad_norm": grad_norm} if config.skip_step_on_spikes else {}
  updates, opt_state = tx.update(grads, state.opt_state, trainable, **extra)
  params = optax.apply_updates(trainable, updates)
  if config.routed_bias_update_rate > 0:  # after the optimizer, outside it; kept or dropped with its update
    params = balance_router_bias(params, sums["expert_load"], config.routed_bias_update_rate)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite((params, opt_state))
  # One flag for every leaf's select: without the barrier XLA fuses the whole and-chain over all leaves into
  # each leaf's select (leaves squared instructions: 82K for tiny gemma3, most of its compile time).
  finite = jax.lax.optimization_barrier(finite)
  # Select, not branch: no host round trip, and both states are live at this point anyway.
  params, opt_state = jax.tree.map(
    lambda new, old: jnp.where(finite, new, old), (params, opt_state), (trainable, state.opt_state)
  )
  return params, opt_state, finite


def eval_step(
  graphdef: nnx.GraphDef,
  config: Config,
  params: nnx.State,
  batch: Batch,
  reference: nnx.State | None = None,
  partition: Partition = TRAIN_ALL,
) -> dict[str, jax.Array]:
  """The objective's loss sums on one eval batch (no dropout); the caller adds them over all eval batches.
  `reference`: TrainState.reference for an objective with one (None under LoRA: see reference_params)."""
  objective = objectives.get(config)
  if objective.reference:
    reference = reference_params(partition, params, reference)
  return objective.eval_sums(graphdef, config, params, batch, reference)


def batch_shardings(config: Config, mesh: Mesh) -> dict[str, NamedSharding]:
  """The objective's batch fields, each split over the data axes."""
  fields = objectives.get(config).fields(config)
  return {k: sharding.input_sharding(config, mesh, rank=f.rank) for k, f in fields.items()}


# XLA:CPU (jax 0.11+) hands bfloat16 dots, and the elementwise work fused around them, to YNNPACK. In
# the train step that costs the same op time as XLA's own kernels but 1.75x the wall time on a 2-core
# host (0.75 vs 0.43 s/step for the quick-start model; the time is lost between ops, not in them:
# benchmarks/README.md, "CPU step on jax 0.12"). An empty fusion list keeps XLA's own kernels. float32
# steps run as fast either way (0.680 vs 0.679 s) and keep jax's default, and with it their numerics.
# Other platforms keep their defaults.
CPU_LOW_PRECISION_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def step_compiler_options(config: Config, mesh: Mesh) -> dict[str, Any] | None:
  """The compiler options of the train and eval steps: CPU_LOW_PRECISION_OPTIONS for a CPU mesh and a
  compute dtype below float32, and XLA's dump options with dump_hlo (hlo_dump.py); None when neither."""
  low_precision = jnp.dtype(config.dtype).itemsize < 4
  cpu = CPU_LOW_PRECISION_OPTIONS if mesh.devices.flat[0].platform == "cpu" and low_precision else {}
  return {**cpu, **hlo_dump.compiler_options(config)} or None


def jit_train_step(
  config: Config, mesh: Mesh, tx: optax.GradientTransformation, spec: StateSpec, schedule: optax.Schedule
) -> Any:
  """train_step bound to its static arguments (tx and schedule from one optimizers.build) and jitted
  with shardings; the state is donated."""
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(
    functools.partial(
      train_step,
      spec.graphdef,
      tx,
      schedule,
      config,
      abstract_params=spec.abstract.params,
      plan=spec.plan,
      partition=spec.partition,
    ),
    in_shardings=(spec.shardings, batch_shardings(config, mesh), replicated),
    out_shardings=(spec.shardings, replicated),
    donate_argnums=0,
    compiler_options=step_compiler_options(config, mesh),
  )


def jit_eval_step(config: Config, mesh: Mesh, spec: StateSpec) -> Any:
  """eval_step jitted: (params, batch[, reference]) -> sums; the reference (TrainState.reference) for an
  objective that has one."""
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = (spec.shardings.params, batch_shardings(config, mesh))
  return jax.jit(
    functools.partial(eval_step, spec.graphdef, config, partition=spec.partition),
    in_shardings=shardings + ((spec.shardings.reference,) if objectives.get(config).reference else ()),
    out_shardings=replicated,
    compiler_options=step_compiler_options(config, mesh),
  )
