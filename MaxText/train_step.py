"""The jitted steps: pure, module-level `(state, batch, rng) -> (state, metrics)` once their static
arguments (graphdef, optimizer, learning-rate schedule, config) are bound with functools.partial.
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

from MaxText import dpo, hlo_dump, optimizers, sharding
from MaxText.config import Config
from MaxText.layers import mtp
from MaxText.parallel.plan import Plan
from MaxText.state import TRAIN_ALL, Partition, StateSpec, TrainState, for_inference

Batch = dict[str, jax.Array]  # int32 [B, T]: inputs, targets, *_segmentation, inputs_position


def _lse_and_target(model: Any, hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  logits = model.logits(hidden).astype(jnp.float32)  # [B, t, V]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1), target_logit


def token_logits(model: Any, hidden: jax.Array, targets: jax.Array, tiles: int) -> tuple[jax.Array, jax.Array]:
  """hidden [B, T, D], targets [B, T] -> (logsumexp over the vocabulary, the target's logit), [B, T] each.

  With tiles > 1 the sequence is cut into `tiles` pieces whose float32 logits [B, T/tiles, V] are made,
  reduced and (in the backward pass) remade one piece at a time, so the whole [B, T, V] never exists:
  at a 32K-256K vocabulary those logits are often a step's largest buffer.
  """
  if tiles == 1:
    return _lse_and_target(model, hidden, targets)
  b, t, d = hidden.shape
  pieces = (hidden.reshape(b, tiles, t // tiles, d).swapaxes(0, 1), targets.reshape(b, tiles, -1).swapaxes(0, 1))
  piece = jax.checkpoint(lambda args: _lse_and_target(model, *args))
  lse, target_logit = jax.lax.map(piece, pieces)  # [tiles, B, T/tiles] each
  return lse.swapaxes(0, 1).reshape(b, t), target_logit.swapaxes(0, 1).reshape(b, t)


def loss_sums(graphdef: nnx.GraphDef, config: Config, params: nnx.State, batch: Batch, rng: jax.Array | None):
  """Summed (not averaged) losses over the non-padding target tokens of `batch`.

  Returns (objective, aux): objective = sum(nll + z_loss) over tokens whose targets_segmentation is
  not 0, plus load_balance_loss_weight * the MoE load-balancing loss per token, plus with mtp_num_layers
  mtp_loss_scaling_factor * the mean over depths of the MTP nll sums; aux = {nll, z_loss,
  load_balance_loss, tokens} sums, {mtp_nll, mtp_tokens} (over all depths) with MTP, and with
  routed_bias_update_rate > 0 the routers' expert_load counts (DecoderOutput.expert_load, also additive). Averaging
  happens once over the whole global batch, so gradient accumulation and sharding give the same loss as one big
  batch.
  """
  model = nnx.merge(graphdef, params)
  with_mtp = config.mtp_num_layers > 0
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"], rng)
  out = model.forward(*inputs, hidden_only=True, mtp=with_mtp, images=batch.get("images"))
  tiles = model.plan.loss.tiles_for(*batch["targets"].shape)
  lse, target_logit = token_logits(model, out.logits, batch["targets"], tiles)
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  nll = (lse - target_logit) * mask
  z_loss = config.z_loss_multiplier * jnp.square(lse) * mask
  balance = out.aux_loss * mask.sum()
  aux = {"nll": nll.sum(), "z_loss": z_loss.sum(), "load_balance_loss": balance, "tokens": mask.sum()}
  objective = nll.sum() + z_loss.sum() + config.load_balance_loss_weight * balance
  if with_mtp:
    aux |= _mtp_sums(model, out.mtp, batch, tiles)
    objective = objective + config.mtp_loss_scaling_factor / config.mtp_num_layers * aux["mtp_nll"]
  if config.routed_bias_update_rate > 0:
    aux["expert_load"] = out.expert_load
  return objective, aux


def _mtp_sums(model: Any, hidden: tuple[jax.Array, ...], batch: Batch, tiles: int) -> dict[str, jax.Array]:
  """MTP depth k's hidden states [B, T, D] (k = 1, 2, ...) -> {mtp_nll, mtp_tokens}, summed over the depths
  and the positions whose target k tokens further on exists in their own segment (mtp.shifted_targets).

  The sums join the main loss's, so the objective divides them by the main token count: per depth the
  mean is over N tokens where DeepSeek's is over the N_k < N that have a target (each row or packed
  segment loses its last k), a factor N_k / N close to 1 that keeps the sums additive across micro-batches."""
  nll_sum, tokens = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
  for k, h in enumerate(hidden, 1):
    shifted = mtp.shifted_targets(batch["targets"], batch["targets_segmentation"], k)
    lse, target_logit = token_logits(model, h, shifted.targets, tiles)
    nll_sum, tokens = nll_sum + ((lse - target_logit) * shifted.mask).sum(), tokens + shifted.mask.sum()
  return {"mtp_nll": nll_sum, "mtp_tokens": tokens}


def _pair_logps(graphdef: nnx.GraphDef, config: Config, params: nnx.State, batch: Batch, rng: jax.Array | None):
  model = nnx.merge(graphdef, params)
  out = model.forward(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"], rng, hidden_only=True)
  tiles = model.plan.loss.tiles_for(*batch["targets"].shape)
  lse, target_logit = token_logits(model, out.logits, batch["targets"], tiles)
  return dpo.pair_logps(target_logit - lse, batch["targets_segmentation"])


def preference_sums(
  graphdef: nnx.GraphDef, config: Config, params: nnx.State, reference: nnx.State, batch: Batch, rng: jax.Array | None
):
  """use_dpo: (objective, aux) as loss_sums returns them, for a batch of preference pairs (dpo.py): the policy
  `params` against the `reference` params (reference_params), which get no gradient and no dropout."""
  policy = _pair_logps(graphdef, config, params, batch, rng)
  ref = jax.tree.map(jax.lax.stop_gradient, _pair_logps(graphdef, config, reference, batch, None))
  return dpo.loss_sums(config, policy, ref)


def reference_params(partition: Partition, params: nnx.State, reference: nnx.State | None) -> nnx.State:
  """The DPO reference model's params: TrainState.reference (the frozen starting params), or under LoRA, which
  keeps none, `params` with every adapter zeroed: the frozen base alone, with no second copy of it."""
  if reference is not None:
    return reference
  trainable, frozen = partition.split(params)
  return partition.combine(jax.tree.map(jnp.zeros_like, trainable), frozen)


def aux_zeros(config: Config) -> dict[str, jax.Array]:
  """Zero sums with the keys loss_sums' aux has for `config`: the start of gradient accumulation."""
  keys = ("nll", "z_loss", "load_balance_loss", "tokens") + (("mtp_nll", "mtp_tokens") if config.mtp_num_layers else ())
  keys = dpo.AUX_KEYS if config.use_dpo else keys
  return {k: jnp.zeros((), jnp.float32) for k in keys}


def _grads(graphdef, config, partition, params, frozen, batch, rng, data_axes, reference=None):
  """Summed gradients with respect to `params` (the trainable part of `partition`; `frozen`, the rest or
  None, gets none) and loss sums, over gradient_accumulation_steps micro-batches. use_dpo: preference_sums
  against the `reference` params."""

  def objective(trainable, batch, rng):
    if config.use_dpo:
      return preference_sums(graphdef, config, partition.combine(trainable, frozen), reference, batch, rng)
    return loss_sums(graphdef, config, partition.combine(trainable, frozen), batch, rng)

  grad_fn = jax.grad(objective, has_aux=True)
  micro = config.gradient_accumulation_steps
  if micro == 1:
    return grad_fn(params, batch, rng)

  # Micro-batch i takes rows i, i+micro, ... so that every device holds a share of each micro-batch.
  def split(x):
    x = x.reshape(-1, micro, *x.shape[1:]).swapaxes(0, 1)  # [micro, B/micro, T]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(None, data_axes, None))

  def body(acc, inputs):
    micro_batch, index = inputs
    micro_rng = None if rng is None else jax.random.fold_in(rng, index)
    grads, aux = grad_fn(params, micro_batch, micro_rng)
    return jax.tree.map(jnp.add, acc, (grads, aux)), None

  micro_batches = jax.tree.map(split, batch)
  aux = aux_zeros(config)
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


def max_load_ratio(loads: dict[str, Any]) -> jax.Array:
  """float32 scalar: over the routers in `loads` (int32 [..., E] counts), the largest busiest-expert load over
  the mean load; 1 when every router spreads its tokens evenly."""
  ratios = []
  for load in jax.tree.leaves(loads):
    load = load.astype(jnp.float32)
    ratios.append(jnp.max(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)))
  return jnp.max(jnp.stack(ratios))


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
  """One optimizer step on the global batch; metrics are device scalars. `schedule` is the one that
  drives `tx` (optimizers.build), evaluated here only to log this step's learning rate.

  An update is applied only when the loss, the gradients and the new parameters and optimizer state are
  all finite: otherwise params and opt_state stay as they were (step still advances, so the data order
  and checkpoint numbering do not shift), metrics["update_finite"] is 0 and metrics["step_skipped"] 1.
  Checking the result, not just the loss, catches an overflow one step before it reaches the loss.
  `abstract_params` (StateSpec.abstract.params: shapes and shardings) and the run `plan` let TPU gradients take
  sharding.lane_layout. `partition` (StateSpec.partition) says which parameters train: by default all."""
  data_axes = sharding.data_axes(config)
  # Under LoRA only the adapters are differentiated and updated; the frozen base passes through untouched.
  trainable, frozen = partition.split(state.params)
  reference = reference_params(partition, state.params, state.reference) if config.use_dpo else None
  grads, aux = _grads(graphdef, config, partition, trainable, frozen, batch, rng, data_axes, reference)
  if abstract_params is not None and plan is not None:
    grads = lane_friendly(grads, partition.trainable(abstract_params), plan)
  tokens = jnp.maximum(aux["pairs"] if config.use_dpo else aux["tokens"], 1.0)  # DPO: the mean over pairs
  grads = jax.tree.map(lambda g: g / tokens, grads)
  loss, grad_norm = aux["nll"] / tokens, optax.global_norm(grads)
  extra = {"loss": loss, "grad_norm": grad_norm} if config.skip_step_on_spikes else {}
  updates, opt_state = tx.update(grads, state.opt_state, trainable, **extra)
  params = optax.apply_updates(trainable, updates)
  if config.routed_bias_update_rate > 0:  # after the optimizer, outside it; kept or dropped with its update
    params = balance_router_bias(params, aux["expert_load"], config.routed_bias_update_rate)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite((params, opt_state))
  # Select, not branch: no host round trip, and both states are live at this point anyway.
  params, opt_state = jax.tree.map(
    lambda new, old: jnp.where(finite, new, old), (params, opt_state), (trainable, state.opt_state)
  )
  params = partition.combine(params, frozen)
  spiked = opt_state.skipped if config.skip_step_on_spikes else jnp.array(False)
  metrics = {
    "loss": loss,
    "grad_norm": grad_norm,
    "param_norm": optax.global_norm(params),
    "learning_rate": schedule(state.step),
    "tokens": aux["tokens"],
    "update_finite": finite.astype(jnp.float32),
    "step_skipped": (~finite | spiked).astype(jnp.float32),
  }
  # Only the losses this model has: a dense run's log line stays readable.
  if config.z_loss_multiplier > 0:
    metrics["z_loss"] = aux["z_loss"] / tokens
  if config.num_experts > 1:
    metrics["moe_load_balance_loss"] = aux["load_balance_loss"] / tokens
  if config.routed_bias_update_rate > 0:
    metrics["moe_max_load_ratio"] = max_load_ratio(aux["expert_load"])
  if config.mtp_num_layers:  # unscaled: the mean nll per predicted token over all depths, comparable to loss
    metrics["mtp_loss"] = aux["mtp_nll"] / jnp.maximum(aux["mtp_tokens"], 1.0)
  if config.use_dpo:
    metrics |= dpo.metrics(aux)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(
  graphdef: nnx.GraphDef,
  config: Config,
  params: nnx.State,
  batch: Batch,
  reference: nnx.State | None = None,
  partition: Partition = TRAIN_ALL,
) -> dict[str, jax.Array]:
  """Loss sums on one eval batch (no dropout); the caller averages over all eval batches. The MTP modules,
  if any, do not run: evaluation measures the model that decodes. use_dpo: the preference sums against
  `reference` (TrainState.reference; None under LoRA, see reference_params)."""
  if config.use_dpo:
    return preference_sums(graphdef, config, params, reference_params(partition, params, reference), batch, None)[1]
  _, aux = loss_sums(graphdef, for_inference(config), params, batch, None)
  aux.pop("expert_load", None)  # what the train step balances the routers with: nothing to evaluate
  return aux


def batch_shardings(config: Config, mesh: Mesh) -> dict[str, NamedSharding]:
  data = sharding.input_sharding(config, mesh)
  keys = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")
  out = {k: data for k in keys}
  if config.use_multimodal:  # float32 pixels [B, images_per_row, S, S, C] (data/images.py)
    out["images"] = sharding.input_sharding(config, mesh, rank=5)
  return out


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
  """eval_step jitted: (params, batch[, reference]) -> sums; the reference (TrainState.reference) with use_dpo."""
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = (spec.shardings.params, batch_shardings(config, mesh))
  return jax.jit(
    functools.partial(eval_step, spec.graphdef, config, partition=spec.partition),
    in_shardings=shardings + ((spec.shardings.reference,) if config.use_dpo else ()),
    out_shardings=replicated,
    compiler_options=step_compiler_options(config, mesh),
  )
