"""Knowledge distillation (objective=distill): the student learns a frozen teacher's next-token distribution on
the same batches, with the ordinary next-token loss beside it (docs/distillation.md).

Per target token, with T = distill_temperature, a = distill_alpha and p = softmax(logits / T) of each model:

    forward_kl = KL(p_teacher || p_student) = sum_v p_t (log p_t - log p_s)      (the default)
    reverse_kl = KL(p_student || p_teacher) = sum_v p_s (log p_s - log p_t)
    mix        = m forward_kl + (1 - m) reverse_kl                                m = distill_mix
    loss       = a T^2 kl + (1 - a) nll           nll: the student's next-token loss on the hard label (T = 1)

T^2 keeps the KL's gradients on the scale of the nll's at any temperature (Hinton et al., 2015). The teacher is
TrainState.reference (teacher.py builds its config, teacher.attach reads its params): one forward per
micro-batch inside the jitted step, no gradient, no optimizer state. Its logits are compared with the student's
over the student's vocabulary (teacher.check refuses a teacher whose vocab_size differs). Like every loss here,
everything is a sum over the batch's target tokens; the step divides by their number once.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText import planner, sharding, teacher
from MaxText.config import Config
from MaxText.errors import ConfigError
from MaxText.objectives import lm, topk
from MaxText.objectives.base import Batch, DataBatches, Field, Sources, Sums, loss_tiles
from MaxText.state import param_spec

SUM_KEYS = ("nll", "z_loss", "load_balance_loss", "tokens", "distill_kl", "teacher_nll", "weighted", "alpha")


def kl(student_logits: jax.Array, teacher_logits: jax.Array, temperature: float, kind: str, mix: float) -> jax.Array:
  """[..., V] logits of both models -> [...] the distill_loss divergence of their softmax(logits / temperature)."""
  log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  log_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  forward = lambda: jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)  # noqa: E731
  reverse = lambda: jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)  # noqa: E731
  if kind == "forward_kl":
    return forward()
  if kind == "reverse_kl":
    return reverse()
  return mix * forward() + (1.0 - mix) * reverse()


def _piece(config: Config, student: Any, teach: Any, args: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """One sequence piece: hidden states of both [B, t, D], targets [B, t] -> [B, t] student lse, student target
  logit, divergence, teacher nll."""
  hidden_s, hidden_t, targets = args
  logits_s = student.logits(hidden_s).astype(jnp.float32)  # [B, t, V]
  logits_t = jax.lax.stop_gradient(teach.logits(hidden_t).astype(jnp.float32))
  target_s = jnp.take_along_axis(logits_s, targets[..., None], axis=-1)[..., 0]
  target_t = jnp.take_along_axis(logits_t, targets[..., None], axis=-1)[..., 0]
  divergence = kl(logits_s, logits_t, config.distill_temperature, config.distill_loss, config.distill_mix)
  return jax.nn.logsumexp(logits_s, axis=-1), target_s, divergence, jax.nn.logsumexp(logits_t, axis=-1) - target_t


def topk_kl(log_s: jax.Array, values: jax.Array, lse: jax.Array, temperature: float) -> jax.Array:
  """Offline forward KL over k + 1 outcomes: the teacher's stored top-k tokens and "any other token".

  log_s [..., k]: the student's log-probabilities (at `temperature`) of the stored ids; values [..., k]: the
  teacher's logits there; lse [...]: the log-sum-exp of all its logits / temperature. The teacher's top-k
  probabilities are exact (normalised over the whole vocabulary by lse); the mass r_t it left to the other
  tokens is matched by the student's mass r_s outside the k ids: sum_k p_t (log p_t - log p_s) + r_t log(r_t / r_s).
  """
  log_t = values.astype(jnp.float32) / temperature - lse[..., None]
  rest_t = jnp.clip(1.0 - jnp.exp(log_t).sum(-1), 0.0, 1.0)
  rest_s = jnp.clip(1.0 - jnp.exp(log_s).sum(-1), 1e-9, 1.0)
  rest = rest_t * (jnp.log(jnp.maximum(rest_t, 1e-9)) - jnp.log(rest_s))
  return jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1) + rest


def _topk_piece(config: Config, student: Any, args: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """Offline: hidden [B, t, D], targets [B, t], the stored top-k ids and logits [B, t, k], the teacher's lse
  [B, t] -> [B, t] student lse, student target logit, topk_kl."""
  hidden, targets, ids, values, lse_t = args
  logits = student.logits(hidden).astype(jnp.float32)  # [B, t, V]
  target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  temperature = config.distill_temperature
  picked = jnp.take_along_axis(jax.nn.log_softmax(logits / temperature, axis=-1), ids, axis=-1)  # [B, t, k]
  return jax.nn.logsumexp(logits, axis=-1), target, topk_kl(picked, values, lse_t, temperature)


def tiled(piece: Any, args: tuple[jax.Array, ...], tiles: int) -> tuple[jax.Array, ...]:
  """piece(args) over the whole sequence (args: [B, T, ...] each; results [B, T] each); with tiles > 1 one
  sequence piece at a time (rematerialised in the backward pass), so no [B, T, V] logits exist at once
  (base.token_logits' tiling)."""
  if tiles == 1:
    return piece(args)
  b, t = args[0].shape[:2]
  cut = lambda x: x.reshape(b, tiles, t // tiles, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
  terms = jax.lax.map(jax.checkpoint(piece), tuple(cut(x) for x in args))  # [tiles, B, T/tiles] each
  return tuple(x.swapaxes(0, 1).reshape(b, t) for x in terms)


@functools.lru_cache(maxsize=8)
def _teacher_graphdef(config: Config, mesh: Any) -> nnx.GraphDef:
  teacher_config = teacher.config_of(config)
  return param_spec(teacher_config, None, planner.build(teacher_config, mesh)).graphdef


def teacher_model(config: Config, teacher_params: nnx.State) -> Any:
  """The teacher as a callable model: its graphdef (built once per mesh) merged with TrainState.reference."""
  mesh = jax.sharding.get_abstract_mesh()
  return nnx.merge(_teacher_graphdef(config, None if mesh.empty else mesh), teacher_params)


def alpha_at(config: Config, step: jax.Array | None) -> jax.Array | float:
  """The KL's weight at `step` (steps done before this one): distill_alpha, or with distill_alpha_end >= 0 the
  straight line from distill_alpha at step 0 to distill_alpha_end at the last step (steps - 1)."""
  if config.distill_alpha_end < 0 or step is None:
    return config.distill_alpha
  done = jnp.clip(step.astype(jnp.float32) / max(config.steps - 1, 1), 0.0, 1.0)
  return config.distill_alpha + (config.distill_alpha_end - config.distill_alpha) * done


def distill_sums(
  graphdef, config: Config, params, teacher_params, batch: Batch, rng, step: jax.Array | None = None
) -> tuple[jax.Array, Sums]:
  """(objective, aux): objective = sum over target tokens of a T^2 kl + (1 - a) nll + z-loss (+ the MoE
  balance loss), a = alpha_at(config, step); aux = SUM_KEYS sums (weighted: the first two terms, alpha: a per
  token) and the routers' expert_load with routed_bias_update_rate."""
  student = nnx.merge(graphdef, params)
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  out = student.forward(*inputs, rng, hidden_only=True)
  tiles = loss_tiles(config, student, batch["targets"])
  if config.distill_topk_path:  # offline: the teacher's stored top-k (objectives/topk.py)
    args = (out.logits, batch["targets"], batch["topk_ids"], batch["topk_values"], batch["teacher_lse"])
    lse, target, divergence = tiled(functools.partial(_topk_piece, config, student), args, tiles)
    teacher_nll = -batch["teacher_logp"]
  else:
    teach = teacher_model(config, teacher_params)
    hidden_t = jax.lax.stop_gradient(teach.forward(*inputs, None, hidden_only=True).logits)
    piece = functools.partial(_piece, config, student, teach)
    lse, target, divergence, teacher_nll = tiled(piece, (out.logits, hidden_t, batch["targets"]), tiles)
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  nll, z_loss = (lse - target) * mask, config.z_loss_multiplier * jnp.square(lse) * mask
  aux = {
    "nll": nll.sum(),
    "z_loss": z_loss.sum(),
    "load_balance_loss": out.aux_loss * mask.sum(),
    "tokens": mask.sum(),
    "distill_kl": (divergence * mask).sum(),
    "teacher_nll": (teacher_nll * mask).sum(),
  }
  alpha = alpha_at(config, step)
  aux["weighted"] = alpha * config.distill_temperature**2 * aux["distill_kl"] + (1.0 - alpha) * aux["nll"]
  aux["alpha"] = alpha * aux["tokens"]
  objective = aux["weighted"] + aux["z_loss"] + config.load_balance_loss_weight * aux["load_balance_loss"]
  if config.routed_bias_update_rate > 0:
    aux["expert_load"] = out.expert_load
  return objective, aux


def check(config: Config) -> None:
  """objective=distill's settings, one line each, before anything is built."""
  if not 0.0 <= config.distill_alpha <= 1.0:
    raise ConfigError(f"distill_alpha={config.distill_alpha} is the KL's weight: give a value in [0, 1]")
  if config.distill_alpha_end != -1 and not 0.0 <= config.distill_alpha_end <= 1.0:
    raise ConfigError(
      f"distill_alpha_end={config.distill_alpha_end} is the KL's weight at the last step: give a value in [0, 1], "
      "or -1 for a constant distill_alpha"
    )
  if config.distill_temperature <= 0:
    raise ConfigError(f"distill_temperature={config.distill_temperature} must be > 0 (1: the plain softmax)")
  if not 0.0 <= config.distill_mix <= 1.0:
    raise ConfigError(f"distill_mix={config.distill_mix} is the forward KL's weight: give a value in [0, 1]")
  if config.mtp_num_layers or config.use_multimodal:
    raise ConfigError("objective=distill trains a text model without MTP: set mtp_num_layers=0, use_multimodal=false")
  if not config.distill_topk_path:
    teacher.check(config)
    return
  if config.distill_loss != "forward_kl":
    raise ConfigError(f"distill_loss={config.distill_loss}: the stored top-k (distill_topk_path) give forward_kl only")
  topk.read_meta(config)


class Distillation:
  """objective=distill: a T^2 KL-to-the-teacher + (1 - a) nll, per target token of the global batch."""

  name = "distill"
  reference = True  # TrainState.reference holds the teacher
  perplexity = False  # the loss mixes the KL in: perplexity would mislead (eval_loss is the plain nll)
  denominator = "tokens"

  def fields(self, config: Config) -> dict[str, Field]:
    fields = lm.token_fields(config)
    if config.distill_topk_path:  # the stored teacher: [B, T, k] logits and ids, [B, T] target log-probs
      k = topk.read_meta(config).k
      fields |= {"topk_values": Field(3, np.float32, (k,)), "topk_ids": Field(3, np.int32, (k,))}
      fields |= {"teacher_lse": Field(2, np.float32), "teacher_logp": Field(2, np.float32)}
    return fields

  def sum_keys(self, config: Config) -> tuple[str, ...]:
    return SUM_KEYS

  def loss_sums(self, graphdef, config, params, batch, rng, reference, step=None):
    return distill_sums(graphdef, config, params, reference, batch, rng, step)

  def step_metrics(self, config: Config, sums: Sums, denominator: jax.Array) -> dict[str, jax.Array]:
    """loss: the objective per token (what the step minimises); distill_nll, the hard-label loss; distill_kl;
    teacher_loss, the teacher's own nll on the batch."""
    metrics = {
      "loss": sums["weighted"] / denominator,
      "distill_alpha": sums["alpha"] / denominator,
      "distill_nll": sums["nll"] / denominator,
      "distill_kl": sums["distill_kl"] / denominator,
      "teacher_loss": sums["teacher_nll"] / denominator,
      "tokens": sums["tokens"],
    }
    if config.z_loss_multiplier > 0:
      metrics["z_loss"] = sums["z_loss"] / denominator
    return metrics

  def eval_sums(self, graphdef, config, params, batch, reference) -> Sums:
    _, aux = distill_sums(graphdef, config, params, reference, batch, None)
    aux.pop("expert_load", None)
    return aux

  def eval_metrics(self, config: Config, totals: dict[str, float]) -> dict[str, float]:
    """eval_loss: the student's plain next-token loss on held-out data (comparable with an lm run's)."""
    tokens = max(totals.get("tokens", 0.0), 1.0)
    return {
      "eval_loss": totals.get("nll", 0.0) / tokens,
      "eval_kl": totals.get("distill_kl", 0.0) / tokens,
      "eval_teacher_loss": totals.get("teacher_nll", 0.0) / tokens,
      "eval_tokens": totals.get("tokens", 0.0),
    }

  def sources(self, config: Config, mesh: Any) -> Sources:
    if not config.distill_topk_path:
      return lm.data_sources(config, mesh)
    meta = topk.read_meta(config)
    train = topk.TopkBatches(config, mesh, meta, "train", sharding.global_batch_size(config, mesh), endless=True)
    eval_batch = sharding.global_batch_size(config, mesh, config.eval_per_device_batch_size or None)
    evals = (
      (lambda: topk.TopkBatches(config, mesh, meta, "eval", eval_batch, endless=False))
      if meta.rows.get("eval")
      else None
    )
    return Sources(DataBatches(train), evals)

  def check(self, config: Config, global_batch: int) -> None:
    del global_batch
    check(config)


OBJECTIVE = Distillation()
