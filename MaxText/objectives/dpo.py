"""Direct preference optimisation (objective=dpo): the loss and metrics of chosen/rejected pairs (docs/dpo.md).

A preference batch is an ordinary batch (data/preferences.py) whose rows hold whole pairs: pair k of a row is
its segments 2k - 1 (the chosen conversation) and 2k (the rejected one), each with its own copy of the prompt and
targets_segmentation nonzero on the completion's tokens only. With log p summed over a completion's tokens,

    h = (log p(chosen) - log p_ref(chosen)) - (log p(rejected) - log p_ref(rejected))
    sigmoid: loss = -(1 - s) log sigmoid(beta h) - s log sigmoid(-beta h)        s = dpo_label_smoothing
    ipo:     loss = (h' - 1 / (2 beta))^2       h' as h, with each log p averaged over its completion's tokens

The reference p_ref is the frozen starting model (train_step.reference_params). The rewards are
beta (log p - log p_ref) of each completion. Everything here is a sum over pairs; the train step divides by the
number of pairs of the global batch once, so gradient accumulation and sharding give the same loss.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.objectives import lm
from MaxText.objectives.base import Batch, Field, Sources, Sums, target_logps

# The sums a preference batch adds up: `nll` (the loss), `tokens` (completion tokens) and the keys every loss
# reports (zero here), then the pair counts and rewards the metrics come from.
AUX_KEYS = ("nll", "z_loss", "load_balance_loss", "tokens", "pairs", "dpo_correct", "dpo_chosen", "dpo_rejected")


class PairLogps(NamedTuple):
  logps: jax.Array  # float32 [B, P, 2]: summed log p of pair p's chosen (0) and rejected (1) completion per row
  tokens: jax.Array  # float32 [B, P, 2]: their completion token counts (0: no such pair in the row)


def pair_logps(token_logps: jax.Array, targets_segmentation: jax.Array) -> PairLogps:
  """Per-token log p of the targets [B, T] -> per-pair sums [B, P, 2], P = T // 2 + 1 (room for any segment id
  <= T). Tokens whose targets_segmentation is 0 (prompts, padding) add nothing."""
  b, t = targets_segmentation.shape
  pairs = t // 2 + 1
  mask = (targets_segmentation != 0).astype(jnp.float32)
  rows = jnp.arange(b)[:, None]

  def by_segment(values: jax.Array) -> jax.Array:  # [B, T] -> [B, P, 2]; column 0 (no loss) is dropped
    sums = jnp.zeros((b, 2 * pairs + 1), jnp.float32).at[rows, targets_segmentation].add(values)
    return sums[:, 1:].reshape(b, pairs, 2)

  return PairLogps(by_segment(token_logps.astype(jnp.float32) * mask), by_segment(mask))


def loss_sums(config: Config, policy: PairLogps, reference: PairLogps) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(objective, aux): objective = the loss summed over the batch's pairs; aux = AUX_KEYS sums."""
  valid = ((policy.tokens[..., 0] > 0) & (policy.tokens[..., 1] > 0)).astype(jnp.float32)  # [B, P]
  ratio = policy.logps - reference.logps  # [B, P, 2]: log p / p_ref of each completion
  beta = config.dpo_beta
  if config.dpo_loss == "ipo":
    mean = ratio / jnp.maximum(policy.tokens, 1.0)
    h = mean[..., 0] - mean[..., 1]
    losses = jnp.square(h - 1.0 / (2.0 * beta))
  else:
    h = ratio[..., 0] - ratio[..., 1]
    smooth = config.dpo_label_smoothing
    losses = -(1.0 - smooth) * jax.nn.log_sigmoid(beta * h) - smooth * jax.nn.log_sigmoid(-beta * h)
  rewards = jax.lax.stop_gradient(beta * ratio) * valid[..., None]
  zero = jnp.zeros((), jnp.float32)
  aux = {
    "nll": (losses * valid).sum(),
    "z_loss": zero,
    "load_balance_loss": zero,
    "tokens": (policy.tokens * valid[..., None]).sum(),
    "pairs": valid.sum(),
    "dpo_correct": ((rewards[..., 0] > rewards[..., 1]) * valid).sum(),
    "dpo_chosen": rewards[..., 0].sum(),
    "dpo_rejected": rewards[..., 1].sum(),
  }
  return aux["nll"], aux


def metrics(aux: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Means over the batch's pairs of what loss_sums added up (device scalars or host floats)."""
  pairs = jnp.maximum(aux["pairs"], 1.0)
  chosen, rejected = aux["dpo_chosen"] / pairs, aux["dpo_rejected"] / pairs
  return {
    "dpo_reward_margin": chosen - rejected,
    "dpo_accuracy": aux["dpo_correct"] / pairs,
    "dpo_chosen_reward": chosen,
    "dpo_rejected_reward": rejected,
    "dpo_pairs": aux["pairs"],
  }


def preference_sums(graphdef, config: Config, params, reference, batch: Batch, rng: jax.Array | None):
  """(objective, aux) for a batch of preference pairs: the policy `params` against the `reference` params
  (train_step.reference_params), which get no gradient and no dropout."""
  policy = pair_logps(target_logps(graphdef, config, params, batch, rng), batch["targets_segmentation"])
  ref = pair_logps(target_logps(graphdef, config, reference, batch, None), batch["targets_segmentation"])
  return loss_sums(config, policy, jax.tree.map(jax.lax.stop_gradient, ref))


class Preference:
  """objective=dpo (use_dpo=true): the mean DPO/IPO loss per pair of the global batch."""

  name = "dpo"
  reference = True
  perplexity = False  # a preference loss is no language-model nll
  denominator = "pairs"

  def fields(self, config: Config) -> dict[str, Field]:
    return lm.token_fields(config)

  def sum_keys(self, config: Config) -> tuple[str, ...]:
    return AUX_KEYS

  def loss_sums(self, graphdef, config, params, batch, rng, reference, step=None):
    del step
    return preference_sums(graphdef, config, params, reference, batch, rng)

  def step_metrics(self, config: Config, sums: Sums, denominator: jax.Array) -> dict[str, jax.Array]:
    return lm.step_metrics(config, sums, denominator) | metrics(sums)

  def eval_sums(self, graphdef, config, params, batch, reference) -> Sums:
    return preference_sums(graphdef, config, params, reference, batch, None)[1]

  def eval_metrics(self, config: Config, totals: dict[str, float]) -> dict[str, Any]:
    return {"eval_loss": totals.get("nll", 0.0) / max(totals.get("pairs", 0.0), 1.0), **metrics(totals)}

  def sources(self, config: Config, mesh: Any) -> Sources:
    return lm.data_sources(config, mesh)  # data/preferences.py

  def check(self, config: Config, global_batch: int) -> None:
    del config, global_batch


OBJECTIVE = Preference()
