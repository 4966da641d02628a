"""ORPO (objective=orpo): supervised fine-tuning on the chosen replies plus an odds-ratio preference term, with no
reference model (docs/dpo.md).

Hong, Lee and Thorne (2024). With p = exp(mean log-probability per completion token) of a reply and its odds
p / (1 - p):

    log_odds = log odds(chosen) - log odds(rejected)
    loss = -mean log p(chosen's tokens) - lambda * log sigmoid(log_odds)

The first term is the chosen reply's nll per token (SFT), the second the preference. Batches are objective=dpo's
(data/preferences.py); sums over pairs, divided once by the global batch's pair count. The rewards logged are
lambda * the mean log-probability per token of each side, as TRL logs ORPO's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.objectives import dpo, simpo

# p = 1 exactly has infinite odds: the mean log-probability is held below 0 by this much.
MAX_MEAN_LOGP = -1e-6


def log1m_exp(x: jax.Array) -> jax.Array:
  """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2."""
  return jnp.where(x < -jnp.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def log_odds(mean: jax.Array) -> jax.Array:
  """log(p / (1 - p)) of p = exp(mean), mean [..., 2] -> chosen's minus rejected's [...]."""
  mean = jnp.minimum(mean, MAX_MEAN_LOGP)
  odds = mean - log1m_exp(mean)
  return odds[..., 0] - odds[..., 1]


def loss_sums(config: Config, pairs: dpo.PairLogps) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(objective, sums): the ORPO loss summed over the batch's pairs; KEYS' sums, plus the SFT term (`sft_nll`)
  and the log odds ratio (`log_odds`) summed over the pairs."""
  mean, valid = simpo.mean_logps(pairs)
  ratio = log_odds(mean)
  sft = -mean[..., 0]
  losses = sft - config.orpo_lambda * jax.nn.log_sigmoid(ratio)
  sums = {
    "nll": (losses * valid).sum(),
    "sft_nll": jax.lax.stop_gradient(sft * valid).sum(),
    "log_odds": jax.lax.stop_gradient(ratio * valid).sum(),
    **simpo.reward_sums(config.orpo_lambda * mean, valid, pairs.tokens),
  }
  return sums["nll"], sums


class ORPO(simpo.PairObjective):
  """objective=orpo: the mean ORPO loss per pair of the global batch."""

  name = "orpo"
  keys = (*simpo.KEYS, "sft_nll", "log_odds")

  def pair_sums(self, config: Config, pairs: dpo.PairLogps) -> tuple[jax.Array, dict[str, jax.Array]]:
    return loss_sums(config, pairs)

  def metrics(self, sums: dict[str, Any]) -> dict[str, Any]:
    pairs = jnp.maximum(sums["pairs"], 1.0)
    means = {"orpo_sft_loss": sums["sft_nll"] / pairs, "orpo_log_odds_ratio": sums["log_odds"] / pairs}
    return simpo.reward_metrics(self.name, sums) | means


OBJECTIVE = ORPO()
