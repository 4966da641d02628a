"""SimPO and ORPO (objective=simpo | orpo): each loss equals a hand computation on a tiny batch of pairs, a short run
on preference pairs (read with the SentencePiece tokenizer, no chat template) lowers it with no reference model in
the train state, and bad settings fail at load in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText import config, objectives, train
from MaxText import state as state_lib
from MaxText.errors import ConfigError
from MaxText.objectives import dpo, orpo, simpo
from MaxText.tests.conftest import BASE, TINY, mesh_of
from MaxText.tests.helpers import write_jsonl

# Two rows: row 0 holds two pairs, row 1 one pair and an empty slot. Summed log p and token counts per side.
LOGPS = np.array([[[-2.0, -6.0], [-9.0, -4.5]], [[-1.5, -1.2], [0.0, 0.0]]], np.float32)
TOKENS = np.array([[[2, 3], [3, 1]], [[1, 2], [0, 0]]], np.float32)
PAIRS = dpo.PairLogps(jnp.asarray(LOGPS), jnp.asarray(TOKENS))
VALID = np.array([[1, 1], [1, 0]], bool)


def log_sigmoid(x):
  return -np.log1p(np.exp(-x))


def test_simpo_loss_is_the_hand_computation():
  c = config.load([BASE, *TINY, "simpo_beta=2.5", "simpo_gamma=1.25"], {})
  loss, sums = simpo.loss_sums(c, PAIRS)
  mean = (LOGPS / np.maximum(TOKENS, 1))[VALID]  # [3 pairs, 2]
  rewards = 2.5 * mean
  expected = -log_sigmoid(rewards[:, 0] - rewards[:, 1] - 1.25)
  np.testing.assert_allclose(float(loss), expected.sum(), rtol=1e-6)
  assert float(sums["pairs"]) == 3 and float(sums["tokens"]) == TOKENS[VALID].sum()
  assert float(sums["correct"]) == (rewards[:, 0] > rewards[:, 1]).sum() == 2
  metrics = simpo.OBJECTIVE.step_metrics(c, sums, sums["pairs"])
  np.testing.assert_allclose(float(metrics["loss"]), expected.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["simpo_reward_margin"]), (rewards[:, 0] - rewards[:, 1]).mean(), rtol=1e-6)
  np.testing.assert_allclose(float(metrics["simpo_accuracy"]), 2 / 3, rtol=1e-6)


def test_orpo_loss_is_the_hand_computation():
  c = config.load([BASE, *TINY, "orpo_lambda=0.25"], {})
  loss, sums = orpo.loss_sums(c, PAIRS)
  mean = (LOGPS / np.maximum(TOKENS, 1))[VALID].astype(np.float64)
  odds = mean - np.log1p(-np.exp(mean))  # log(p / (1 - p)), p = exp(mean log p per token)
  ratio = odds[:, 0] - odds[:, 1]
  expected = -mean[:, 0] - 0.25 * log_sigmoid(ratio)
  np.testing.assert_allclose(float(loss), expected.sum(), rtol=1e-5)
  metrics = orpo.OBJECTIVE.step_metrics(c, sums, sums["pairs"])
  np.testing.assert_allclose(float(metrics["orpo_sft_loss"]), -mean[:, 0].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["orpo_log_odds_ratio"]), ratio.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["orpo_accuracy"]), (ratio > 0).mean(), rtol=1e-6)


def test_orpo_stays_finite_when_a_reply_is_certain():
  """p = 1 (mean log p 0) has infinite odds: held just below, the loss and its gradient stay finite."""
  c = config.load([BASE, *TINY], {})
  logps = jnp.array([[[0.0, -3.0]]], jnp.float32)
  tokens = jnp.array([[[2.0, 2.0]]], jnp.float32)
  grad = jax.jit(jax.grad(lambda x: orpo.loss_sums(c, dpo.PairLogps(x, tokens))[0]))(logps)  # one compile
  assert np.isfinite(float(orpo.loss_sums(c, dpo.PairLogps(logps, tokens))[0])) and np.isfinite(grad).all()
  np.testing.assert_allclose(orpo.log1m_exp(jnp.array([-1e-3, -0.5, -5.0])), np.log1p(-np.exp([-1e-3, -0.5, -5.0])))


def sums_pairs():
  """'a+b=' prompts: chosen the sum, rejected the next digit."""
  return [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(4) for b in range(3)]


def pair_config(tmp_path, corpus, name, *overrides):
  data = write_jsonl(tmp_path / "p.jsonl", sums_pairs())
  _, model = corpus
  args = [BASE, f"run_name={name}", f"base_output_directory={tmp_path}", *TINY, "dataset_type=text"]
  args += [f"dataset_path={data}", f"tokenizer_path={model}", "vocab_size=512", "eval_fraction=0"]
  return config.load([*args, f"objective={name}", *overrides], {})


@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_a_short_run_lowers_the_loss_with_no_reference(tmp_path, corpus, name):
  # One pair per row and all 12 in each batch: every step's loss is over the same pairs.
  run = ("steps=4", "packing=false", "per_device_batch_size=12", "max_target_length=32", "learning_rate=3e-3")
  c = pair_config(tmp_path, corpus, name, *run)
  assert not objectives.get(c).reference and not state_lib.keeps_reference(c)
  assert state_lib.state_spec(c, optax.sgd(0.1), mesh_of(c, 1)).abstract.reference is None
  train.run(c, jax.devices()[:1])
  with open(c.metrics_file) as f:
    records = [json.loads(line) for line in f]
  first, last = records[0], records[-1]
  loss = [r["loss"] for r in records]
  assert all(b < a for a, b in zip(loss, loss[1:])), loss  # e.g. simpo 1.50 0.74 0.37 0.13
  assert last[f"{name}_reward_margin"] > first[f"{name}_reward_margin"]
  assert first[f"{name}_pairs"] == 12 and {f"{name}_reward_margin", f"{name}_accuracy"} <= set(first)
  assert "perplexity" not in first


def test_bad_settings_fail_at_load(tmp_path, corpus):
  for key, value, match in [
    ("simpo_beta", "0", "simpo_beta=0.0 must be > 0"),
    ("simpo_gamma", "-1", "simpo_gamma=-1.0 must be >= 0"),
    ("orpo_lambda", "-0.5", "orpo_lambda=-0.5 must be >= 0"),
  ]:
    with pytest.raises(ConfigError, match=match) as e:
      pair_config(tmp_path, corpus, "simpo", f"{key}={value}")
    assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match="objective=orpo and use_sft=true"):
    pair_config(tmp_path, corpus, "orpo", "use_sft=true")
  with pytest.raises(ConfigError, match="objective=simpo reads dataset_type=text"):
    pair_config(tmp_path, corpus, "simpo", "dataset_type=synthetic")
