"""SimPO (objective=simpo): DPO's preference pairs without a reference model (docs/dpo.md).

Meng, Xia and Chen (2024). Each reply's reward is its mean log-probability per completion token, scaled by beta;
the loss asks the chosen reward to beat the rejected one by a target margin gamma:

    r = beta * (log p(reply)) / |reply|                 (log p summed over the completion's tokens)
    loss = -log sigmoid(r(chosen) - r(rejected) - gamma)

Batches are objective=dpo's (data/preferences.py: pair k of a row is segments 2k - 1 and 2k); dpo.pair_logps
sums each side's log-probabilities. Everything here is a sum over pairs; the step divides by the global batch's
pair count once. The pair helpers below (mean_logps, reward_sums, reward_metrics) are ORPO's too (orpo.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from MaxText.config import Config
from MaxText.objectives import dpo, lm
from MaxText.objectives.base import Batch, Field, Sources, Sums, target_logps

KEYS = ("nll", "tokens", "pairs", "correct", "chosen", "rejected")  # the sums a batch of pairs adds up


def mean_logps(pairs: dpo.PairLogps) -> tuple[jax.Array, jax.Array]:
  """(mean log p per completion token [B, P, 2], valid [B, P]: 1 where the row has the whole pair)."""
  valid = ((pairs.tokens[..., 0] > 0) & (pairs.tokens[..., 1] > 0)).astype(jnp.float32)
  return pairs.logps / jnp.maximum(pairs.tokens, 1.0), valid


def reward_sums(rewards: jax.Array, valid: jax.Array, tokens: jax.Array) -> dict[str, jax.Array]:
  """Sums over the valid pairs of rewards [B, P, 2] (chosen, rejected): no gradient flows through them."""
  rewards = jax.lax.stop_gradient(rewards) * valid[..., None]
  return {
    "tokens": (tokens * valid[..., None]).sum(),
    "pairs": valid.sum(),
    "correct": ((rewards[..., 0] > rewards[..., 1]) * valid).sum(),
    "chosen": rewards[..., 0].sum(),
    "rejected": rewards[..., 1].sum(),
  }


def reward_metrics(prefix: str, sums: dict[str, Any]) -> dict[str, Any]:
  """Means over the pairs of reward_sums' sums (device scalars or host floats), named `{prefix}_...` as DPO's."""
  pairs = jnp.maximum(sums["pairs"], 1.0)
  chosen, rejected = sums["chosen"] / pairs, sums["rejected"] / pairs
  return {
    f"{prefix}_reward_margin": chosen - rejected,
    f"{prefix}_accuracy": sums["correct"] / pairs,
    f"{prefix}_chosen_reward": chosen,
    f"{prefix}_rejected_reward": rejected,
    f"{prefix}_pairs": sums["pairs"],
  }


def loss_sums(config: Config, pairs: dpo.PairLogps) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(objective, sums): the SimPO loss summed over the batch's pairs, and KEYS' sums."""
  mean, valid = mean_logps(pairs)
  rewards = config.simpo_beta * mean  # [B, P, 2]
  losses = -jax.nn.log_sigmoid(rewards[..., 0] - rewards[..., 1] - config.simpo_gamma)
  sums = {"nll": (losses * valid).sum(), **reward_sums(rewards, valid, pairs.tokens)}
  return sums["nll"], sums


def batch_pairs(graphdef, config: Config, params, batch: Batch, rng) -> dpo.PairLogps:
  """The summed log p of each pair's sides under `params` (no reference)."""
  return dpo.pair_logps(target_logps(graphdef, config, params, batch, rng), batch["targets_segmentation"])


class PairObjective:
  """What SimPO and ORPO share: the preference batches, the pair denominator, no reference, the reward metrics.
  A subclass gives `name` and `pair_sums(config, pairs) -> (objective, sums)`."""

  name = ""
  reference = False  # no frozen copy of the params: the train state holds none
  perplexity = False
  denominator = "pairs"
  keys: tuple[str, ...] = KEYS

  def pair_sums(self, config: Config, pairs: dpo.PairLogps) -> tuple[jax.Array, dict[str, jax.Array]]:
    raise NotImplementedError

  def fields(self, config: Config) -> dict[str, Field]:
    return lm.token_fields(config)

  def sum_keys(self, config: Config) -> tuple[str, ...]:
    return self.keys

  def loss_sums(self, graphdef, config, params, batch, rng, reference, step=None):
    del reference, step
    return self.pair_sums(config, batch_pairs(graphdef, config, params, batch, rng))

  def metrics(self, sums: dict[str, Any]) -> dict[str, Any]:
    return reward_metrics(self.name, sums)

  def step_metrics(self, config: Config, sums: Sums, denominator: jax.Array) -> dict[str, jax.Array]:
    return {"loss": sums["nll"] / denominator, "tokens": sums["tokens"], **self.metrics(sums)}

  def eval_sums(self, graphdef, config, params, batch, reference) -> Sums:
    del reference
    return self.pair_sums(config, batch_pairs(graphdef, config, params, batch, None))[1]

  def eval_metrics(self, config: Config, totals: dict[str, float]) -> dict[str, Any]:
    return {"eval_loss": totals.get("nll", 0.0) / max(totals.get("pairs", 0.0), 1.0), **self.metrics(totals)}

  def sources(self, config: Config, mesh: Any) -> Sources:
    return lm.data_sources(config, mesh)  # data/preferences.py, as objective=dpo reads them

  def check(self, config: Config, global_batch: int) -> None:
    del config, global_batch


class SimPO(PairObjective):
  """objective=simpo: the mean SimPO loss per pair of the global batch."""

  name = "simpo"

  def pair_sums(self, config: Config, pairs: dpo.PairLogps) -> tuple[jax.Array, dict[str, jax.Array]]:
    return loss_sums(config, pairs)


OBJECTIVE = SimPO()
