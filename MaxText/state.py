"""The train state: abstract shapes and shardings via jax.eval_shape, then sharded initialisation.

Shared by train, train_compile, decode and checkpointing: all of them need the same abstract state.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from MaxText import models, sharding
from MaxText.config import Config


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: nnx.State  # model parameters (nnx.Param variables, logical axis names in their metadata)
  opt_state: optax.OptState


class StateSpec(NamedTuple):
  graphdef: nnx.GraphDef  # the model's structure; merge with params to get a callable model
  abstract: TrainState  # jax.ShapeDtypeStruct leaves carrying their NamedSharding
  shardings: TrainState  # NamedSharding leaves
  num_params: int


def _init_fn(config: Config, tx: optax.GradientTransformation):
  def init() -> TrainState:
    model = models.build(config, nnx.Rngs(params=config.init_weights_seed))
    _, params = nnx.split(model, nnx.Param)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  return init


def graphdef(config: Config) -> nnx.GraphDef:
  return nnx.split(nnx.eval_shape(lambda: models.build(config, nnx.Rngs(params=0))), nnx.Param)[0]


def state_spec(config: Config, tx: optax.GradientTransformation, mesh: Mesh) -> StateSpec:
  """Shapes, dtypes and shardings of the whole train state, without allocating it."""
  abstract = jax.eval_shape(_init_fn(config, tx))
  # Variables map to their logical spec; plain leaves (step, optimizer counters) are replicated.
  logical = nnx.get_partition_spec(abstract)
  shardings = sharding.logical_to_mesh(logical, mesh, sharding.axis_rules(config))
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
  num_params = sum(x.size for x in jax.tree.leaves(abstract.params))
  return StateSpec(graphdef(config), abstract, shardings, num_params)


def init_state(config: Config, tx: optax.GradientTransformation, spec: StateSpec) -> TrainState:
  """Initialise directly into the sharded layout: each device computes only its own shards."""
  return jax.jit(_init_fn(config, tx), out_shardings=spec.shardings)()
