"""Language modelling (objective=lm): pre-training, and SFT's masked loss (use_sft, a data choice: the same loss
over the completion tokens only). Next-token cross-entropy plus z-loss, the MoE load-balancing loss and the
multi-token-prediction losses, each summed over the batch's non-padding target tokens."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText import data as data_lib
from MaxText.config import Config
from MaxText.layers import mtp
from MaxText.objectives.base import TOKEN_FIELDS, Batch, DataBatches, Field, Sources, Sums, loss_tiles, token_logits
from MaxText.state import for_inference


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
  tiles = loss_tiles(config, model, batch["targets"])
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


def sum_keys(config: Config) -> tuple[str, ...]:
  """The keys loss_sums' aux has for `config` (expert_load apart: its shapes are the model's)."""
  return ("nll", "z_loss", "load_balance_loss", "tokens") + (("mtp_nll", "mtp_tokens") if config.mtp_num_layers else ())


def max_load_ratio(loads: dict[str, Any]) -> jax.Array:
  """float32 scalar: over the routers in `loads` (int32 [..., E] counts), the largest busiest-expert load over
  the mean load; 1 when every router spreads its tokens evenly."""
  ratios = []
  for load in jax.tree.leaves(loads):
    load = load.astype(jnp.float32)
    ratios.append(jnp.max(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)))
  return jnp.max(jnp.stack(ratios))


def step_metrics(config: Config, sums: Sums, tokens: jax.Array) -> dict[str, jax.Array]:
  """loss (the mean nll per `tokens`, the step's denominator), the token count, and only the other losses this
  model has: a dense run's log line stays readable."""
  metrics = {"loss": sums["nll"] / tokens, "tokens": sums["tokens"]}
  if config.z_loss_multiplier > 0:
    metrics["z_loss"] = sums["z_loss"] / tokens
  if config.num_experts > 1:
    metrics["moe_load_balance_loss"] = sums["load_balance_loss"] / tokens
  if config.routed_bias_update_rate > 0:
    metrics["moe_max_load_ratio"] = max_load_ratio(sums["expert_load"])
  if config.mtp_num_layers:  # unscaled: the mean nll per predicted token over all depths, comparable to loss
    metrics["mtp_loss"] = sums["mtp_nll"] / jnp.maximum(sums["mtp_tokens"], 1.0)
  return metrics


def data_sources(config: Config, mesh: Any) -> Sources:
  """The data pipeline's train and eval iterators (MaxText.data: pre-training text, use_sft chats, DPO pairs)."""
  iterators = data_lib.make_iterators(config, mesh)
  return Sources(DataBatches(iterators.train), iterators.eval_factory, iterators.sample_prompt)


def token_fields(config: Config) -> dict[str, Field]:
  """The packed token batch (MaxText.data.FIELDS), plus with use_multimodal the float32 pixels
  [B, images_per_row, S, S, C] (data/images.py)."""
  fields = {k: Field(2) for k in TOKEN_FIELDS}
  if config.use_multimodal:
    fields["images"] = Field(5, np.float32)
  return fields


class LanguageModel:
  """objective=lm: the mean next-token nll over the global batch's target tokens."""

  name = "lm"
  reference = False
  perplexity = True
  denominator = "tokens"

  def fields(self, config: Config) -> dict[str, Field]:
    return token_fields(config)

  def sum_keys(self, config: Config) -> tuple[str, ...]:
    return sum_keys(config)

  def loss_sums(self, graphdef, config, params, batch, rng, reference=None, step=None):
    del reference, step
    return loss_sums(graphdef, config, params, batch, rng)

  def step_metrics(self, config: Config, sums: Sums, denominator: jax.Array) -> dict[str, jax.Array]:
    return step_metrics(config, sums, denominator)

  def eval_sums(self, graphdef, config, params, batch, reference=None) -> Sums:
    """The MTP modules, if any, do not run: evaluation measures the model that decodes."""
    del reference
    _, aux = loss_sums(graphdef, for_inference(config), params, batch, None)
    aux.pop("expert_load", None)  # what the train step balances the routers with: nothing to evaluate
    return aux

  def eval_metrics(self, config: Config, totals: dict[str, float]) -> dict[str, float]:
    nll, tokens = totals.get("nll", 0.0), totals.get("tokens", 0.0)
    return {"eval_loss": nll / max(tokens, 1.0), "eval_tokens": tokens}

  def sources(self, config: Config, mesh: Any) -> Sources:
    return data_sources(config, mesh)

  def check(self, config: Config, global_batch: int) -> None:
    del config, global_batch


OBJECTIVE = LanguageModel()
