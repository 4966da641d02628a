"""Knowledge distillation (objective=distill): the student learns a frozen teacher's next-token distribution on
the same batches, with the ordinary next-token loss beside it (docs/distillation.md).

Per target token, with T = distill_temperature, a = distill_alpha and p = softmax(logits / T) of each model:

    forward_kl = KL(p_teacher || p_student) = sum_v p_t (log p_t - log p_s)      (the default)
    reverse_kl = KL(p_student || p_teacher) = sum_v p_s (log p_s - log p_t)
    mix        = m forward_kl + (1 - m) reverse_kl                                m = distill_mix
    loss       = a T^2 kl + (1 - a) nll           nll: the student's next-token loss on the hard label (T = 1)

T^2 keeps the KL's gradients on the scale of the nll's at any temperature (Hinton et al., 2015). The teacher is
TrainState.reference (teacher.py builds its config, checkpointing.with_teacher reads its params): one forward per
micro-batch inside the jitted step, no gradient, no optimizer state. Its logits are compared with the student's
over the student's vocabulary (teacher.check refuses a teacher whose vocab_size differs). Like every loss here,
everything is a sum over the batch's target tokens; the step divides by their number once.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from MaxText import planner, teacher
from MaxText.config import Config
from MaxText.errors import ConfigError
from MaxText.objectives import lm
from MaxText.objectives.base import Batch, Field, Sources, Sums, loss_tiles
from MaxText.state import param_spec

SUM_KEYS = ("nll", "z_loss", "load_balance_loss", "tokens", "distill_kl", "teacher_nll")


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


def token_terms(config: Config, student: Any, teach: Any, hidden_s, hidden_t, targets, tiles: int):
  """_piece over the whole sequence; with tiles > 1 one piece at a time (rematerialised in the backward pass), so
  neither model's [B, T, V] logits exist at once (base.token_logits' tiling)."""
  if tiles == 1:
    return _piece(config, student, teach, (hidden_s, hidden_t, targets))
  b, t = targets.shape
  cut = lambda x: x.reshape(b, tiles, t // tiles, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
  piece = jax.checkpoint(functools.partial(_piece, config, student, teach))
  terms = jax.lax.map(piece, (cut(hidden_s), cut(hidden_t), cut(targets)))  # [tiles, B, T/tiles] each
  return tuple(x.swapaxes(0, 1).reshape(b, t) for x in terms)


@functools.lru_cache(maxsize=8)
def _teacher_graphdef(config: Config, mesh: Any) -> nnx.GraphDef:
  teacher_config = teacher.config_of(config)
  return param_spec(teacher_config, None, planner.build(teacher_config, mesh)).graphdef


def teacher_model(config: Config, teacher_params: nnx.State) -> Any:
  """The teacher as a callable model: its graphdef (built once per mesh) merged with TrainState.reference."""
  mesh = jax.sharding.get_abstract_mesh()
  return nnx.merge(_teacher_graphdef(config, None if mesh.empty else mesh), teacher_params)


def distill_sums(graphdef, config: Config, params, teacher_params, batch: Batch, rng) -> tuple[jax.Array, Sums]:
  """(objective, aux): objective = sum over target tokens of a T^2 kl + (1 - a) nll + z-loss (+ the MoE
  balance loss); aux = SUM_KEYS sums (and the routers' expert_load with routed_bias_update_rate)."""
  student = nnx.merge(graphdef, params)
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  out = student.forward(*inputs, rng, hidden_only=True)
  teach = teacher_model(config, teacher_params)
  hidden_t = jax.lax.stop_gradient(teach.forward(*inputs, None, hidden_only=True).logits)
  tiles = loss_tiles(config, student, batch["targets"])
  terms = token_terms(config, student, teach, out.logits, hidden_t, batch["targets"], tiles)
  lse, target, divergence, teacher_nll = terms
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
  alpha, temperature = config.distill_alpha, config.distill_temperature
  objective = alpha * temperature**2 * aux["distill_kl"] + (1.0 - alpha) * aux["nll"] + aux["z_loss"]
  objective = objective + config.load_balance_loss_weight * aux["load_balance_loss"]
  if config.routed_bias_update_rate > 0:
    aux["expert_load"] = out.expert_load
  return objective, aux


def check(config: Config) -> None:
  """objective=distill's settings, one line each, before anything is built."""
  if not 0.0 <= config.distill_alpha <= 1.0:
    raise ConfigError(f"distill_alpha={config.distill_alpha} is the KL's weight: give a value in [0, 1]")
  if config.distill_temperature <= 0:
    raise ConfigError(f"distill_temperature={config.distill_temperature} must be > 0 (1: the plain softmax)")
  if not 0.0 <= config.distill_mix <= 1.0:
    raise ConfigError(f"distill_mix={config.distill_mix} is the forward KL's weight: give a value in [0, 1]")
  if config.mtp_num_layers or config.use_multimodal:
    raise ConfigError("objective=distill trains a text model without MTP: set mtp_num_layers=0, use_multimodal=false")
  teacher.check(config)


class Distillation:
  """objective=distill: a T^2 KL-to-the-teacher + (1 - a) nll, per target token of the global batch."""

  name = "distill"
  reference = True  # TrainState.reference holds the teacher
  perplexity = False  # the loss mixes the KL in: perplexity would mislead (eval_loss is the plain nll)
  denominator = "tokens"

  def fields(self, config: Config) -> dict[str, Field]:
    return lm.token_fields(config)

  def sum_keys(self, config: Config) -> tuple[str, ...]:
    return SUM_KEYS

  def loss_sums(self, graphdef, config, params, batch, rng, reference):
    return distill_sums(graphdef, config, params, reference, batch, rng)

  def step_metrics(self, config: Config, sums: Sums, denominator: jax.Array) -> dict[str, jax.Array]:
    """loss: the objective per token (what the step minimises); distill_nll, the hard-label loss; distill_kl;
    teacher_loss, the teacher's own nll on the batch."""
    alpha, temperature = config.distill_alpha, config.distill_temperature
    loss = alpha * temperature**2 * sums["distill_kl"] + (1.0 - alpha) * sums["nll"]
    metrics = {
      "loss": loss / denominator,
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
    return lm.data_sources(config, mesh)

  def check(self, config: Config, global_batch: int) -> None:
    del global_batch
    check(config)


OBJECTIVE = Distillation()
