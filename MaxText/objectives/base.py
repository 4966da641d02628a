"""What every objective gives the trainer (docs/objectives.md): the Objective protocol, the batch sources, and the
logits helpers the losses share.

The trainer (train.py, train_step.py) runs one loop and one jitted step for every objective. An objective says
which fields its batches have, what its loss adds up over a batch (sums, so that gradient accumulation and
sharding give the loss of one big batch), which of those sums the step divides by, which metrics it reports,
and where its batches come from (a data pipeline, or rollouts sampled from the current parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.config import Config

Batch = dict[str, jax.Array]  # the fields Objective.fields names, global arrays sharded over the data axes
Sums = dict[str, jax.Array]  # float32 scalars (and MoE expert loads) that add up over micro-batches


class Field(NamedTuple):
  rank: int  # axes; the first is the batch (split over the data axes), the second (if any) max_target_length
  dtype: Any = np.int32
  tail: tuple[int, ...] = ()  # the sizes of the axes after [batch, max_target_length] (rank 3+)


TOKEN_FIELDS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")


class Fetched(NamedTuple):
  """One step's batch and the host metrics that came with it (e.g. GRPO's rewards), logged with that step."""

  batch: Batch
  metrics: Mapping[str, float]


class Batches(Protocol):
  """Where the train batches come from. next(state) gets the batch of the next step; `state` is the train state
  that step will update (a sampler reads its params). get_state/set_state: what a checkpoint saves and a resume
  restores (JSON)."""

  def next(self, state: Any) -> Fetched: ...
  def get_state(self) -> Any: ...
  def set_state(self, state: Any) -> None: ...
  def describe(self) -> list[str]: ...


class DataBatches:
  """A data pipeline's iterator (MaxText.data) as Batches: the state is not needed."""

  def __init__(self, iterator: Any):
    self.iterator = iterator

  def next(self, state: Any) -> Fetched:
    del state
    return Fetched(next(self.iterator), {})

  def get_state(self) -> Any:
    return self.iterator.get_state()

  def set_state(self, state: Any) -> None:
    self.iterator.set_state(state)

  def describe(self) -> list[str]:
    return []


class Sources(NamedTuple):
  train: Batches
  eval_factory: Any  # () -> an iterator of eval batches; None without eval data
  sample_prompt: str | None = None  # the data's own prompt for the closing summary's decode command


class Objective(Protocol):
  """A training objective. The step calls loss_sums on each micro-batch and adds the sums up (sum_keys plus, with
  routed_bias_update_rate, `expert_load`), divides the gradients by max(sums[denominator], 1), and logs
  step_metrics; `loss` among them is what nan_check, skip_step_on_spikes and the log line read."""

  name: str
  reference: bool  # keeps a frozen copy of the starting params (TrainState.reference; under LoRA: the base)
  perplexity: bool  # its loss is a language-model nll per token: the log shows exp(loss) too
  denominator: str  # the sum the gradients and the loss are divided by: tokens, pairs, rows, ...

  def fields(self, config: Config) -> dict[str, Field]: ...
  def sum_keys(self, config: Config) -> tuple[str, ...]: ...
  # `step`: TrainState.step (a traced int; None outside the train step), for a loss that changes over the run
  # (distill's alpha schedule); the others ignore it.
  def loss_sums(self, graphdef, config, params, batch: Batch, rng, reference, step=None) -> tuple[jax.Array, Sums]: ...
  def step_metrics(self, config: Config, sums: Sums, denominator: jax.Array) -> dict[str, jax.Array]: ...
  def eval_sums(self, graphdef, config, params, batch: Batch, reference) -> Sums: ...
  def eval_metrics(self, config: Config, totals: dict[str, float]) -> dict[str, float]: ...
  def sources(self, config: Config, mesh: Any) -> Sources: ...
  def check(self, config: Config, global_batch: int) -> None: ...


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


def loss_tiles(config: Config, model: Any, targets: jax.Array) -> int:
  """The vocabulary tiles of every objective's loss over `targets` [B, T] (the run plan decides them)."""
  del config
  return model.plan.loss.tiles_for(*targets.shape)


def target_logps(graphdef: nnx.GraphDef, config: Config, params: nnx.State, batch: Batch, rng: Any) -> jax.Array:
  """log p(target | prefix) [B, T] under `params` (no MTP, vocabulary tiling as the LM loss)."""
  model = nnx.merge(graphdef, params)
  out = model.forward(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"], rng, hidden_only=True)
  lse, target_logit = token_logits(model, out.logits, batch["targets"], loss_tiles(config, model, batch["targets"]))
  return target_logit - lse
