"""The one owner of the abstract model: graphdef, abstract parameters and their shardings (via
nnx.eval_shape, nothing allocated), the train state built on them, and sharded initialisation.

Shared by train, train_compile, decode (inference/engine.py), check_logits, the converters and
checkpointing: all of them need the same model structure and the same parameter layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import models, planner, sharding, teacher
from MaxText.config import Config
from MaxText.layers import lora, quantization
from MaxText.parallel.plan import Plan


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: nnx.State  # model parameters (nnx.Param variables, logical axis names in their metadata)
  opt_state: optax.OptState  # of the trainable params: all of them, or under LoRA the adapters (Partition)
  # An objective with a reference (DPO, GRPO; without LoRA): the run's starting params, sharded like params and
  # never updated; not saved in checkpoints (a resume re-reads them: checkpointing.with_reference). Distillation:
  # the frozen teacher's params (teacher.py; read again from teacher_load_parameters_path on resume). Else None.
  reference: nnx.State | None = None


class Split(NamedTuple):
  trainable: nnx.State  # what the optimizer sees: every parameter, or under LoRA the adapters
  frozen: nnx.State | None  # the parameters never updated (under LoRA the base), else None


@dataclasses.dataclass(frozen=True)
class Partition:
  """Which parameters train: the optimizer differentiates, updates and keeps state for those only, and a
  checkpoint holds those only (the frozen rest is read from where the run started: load_parameters_path).
  Decided once per model, in param_spec (lora.trainable_filter); hashable, so it binds into a jitted step."""

  trainable_filter: Any = ...  # an nnx filter over the parameters: ... (all of them) or nnx.LoRAParam

  @property
  def freezes(self) -> bool:
    """Some parameters are frozen (under LoRA: the base)."""
    return self.trainable_filter is not ...

  def split(self, params: nnx.State) -> Split:
    """params (every nnx.Param of the model) -> trainable and frozen parts (frozen None when nothing is)."""
    if not self.freezes:
      return Split(params, None)
    return Split(*nnx.split_state(params, self.trainable_filter, ...))

  def combine(self, trainable: nnx.State, frozen: nnx.State | None) -> nnx.State:
    """The inverse of split: the whole parameter state."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)

  def trainable(self, params: nnx.State) -> nnx.State:
    """The parameters the optimizer updates (and keeps state for): split(params).trainable."""
    return self.split(params).trainable

  def checkpointed(self, state: TrainState) -> TrainState:
    """A TrainState as checkpoints hold it: with frozen parameters, its params are the trainable ones only;
    never the DPO reference (re-derived on resume)."""
    state = state.replace(reference=None)
    return state.replace(params=self.trainable(state.params)) if self.freezes else state


TRAIN_ALL = Partition()  # every parameter trains: the partition without LoRA


class ParamSpec(NamedTuple):
  graphdef: nnx.GraphDef  # the model's structure; nnx.merge(graphdef, params) gives a callable model
  abstract: nnx.State  # nnx.Param variables of jax.ShapeDtypeStruct (with their NamedSharding given a mesh)
  shardings: nnx.State | None  # NamedSharding per parameter; None when built without a mesh
  plan: Plan  # how the model runs (the graphdef holds it too)
  partition: Partition  # which parameters train (all, or under LoRA the adapters)


class StateSpec(NamedTuple):
  graphdef: nnx.GraphDef  # the model's structure; merge with params to get a callable model
  abstract: TrainState  # jax.ShapeDtypeStruct leaves carrying their NamedSharding
  shardings: TrainState  # NamedSharding leaves
  num_params: int  # every parameter (base + adapters under LoRA)
  num_trainable: int  # the parameters the optimizer updates: num_params, or under LoRA the adapters'
  plan: Plan  # how the model runs (the graphdef holds it too)
  partition: Partition  # which parameters train: split, combine, what a checkpoint holds
  teacher: teacher.Teacher | None = None  # objective=distill: the teacher's config and path; its params: reference


def build_model(config: Config, seed: int, plan: Plan) -> nnx.Module:
  """models.build, then what the config layers over the model for training: quantized matmuls
  (layers/quantization.py; the model itself when quantization is off). Every graphdef and parameter tree
  here comes from this one function, so train, train_compile, decode and checkpoints agree."""
  model = models.build(config, nnx.Rngs(params=seed), plan)
  return quantization.quantize(model, config)


def _model_params(config: Config, seed: int, plan: Plan) -> nnx.State:
  return nnx.split(build_model(config, seed, plan), nnx.Param)[1]


def _with_shardings(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _shardings(tree, config: Config, mesh: Mesh):
  # Variables map to their logical spec; plain leaves (step, optimizer counters) are replicated.
  # Under active logical rules (sharding.activate) nnx.get_partition_spec returns mesh axes already, which
  # logical_to_mesh then read as unknown logical names: stacked layers lost `stage`, and `embed` its
  # fallbacks (weights stayed whole across `expert`, `fsdp_transpose`). Without rules it returns the
  # logical names, which logical_to_mesh maps once.
  with nn.logical_axis_rules(()):
    specs = nnx.get_partition_spec(tree)
  named = sharding.logical_to_mesh(specs, mesh, sharding.axis_rules(config))
  return jax.tree.map(_fit, named, tree)


def _fit(named: NamedSharding, leaf: Any) -> Any:
  """The sharding of one state leaf. Optimizer statistics inherit their parameter's axis names: one with fewer
  dims (Adafactor's factored rows and columns) is small and replicated; an empty subtree (optax's MaskedNode, a
  parameter that another part of a partitioned optimizer keeps state for) stays itself."""
  if not hasattr(leaf, "shape"):
    return leaf
  if len(named.spec) > len(leaf.shape):
    return NamedSharding(named.mesh, PartitionSpec())
  return sharding.fit(named, leaf.shape)


# The objectives whose Objective.reference is true (objectives.REGISTRY; objectives_test checks the two agree).
# distill's reference is its teacher (teacher.TEACHER_OBJECTIVES), another model, kept under LoRA too.
REFERENCE_OBJECTIVES = ("dpo", "grpo", "distill")


def keeps_reference(config: Config) -> bool:
  """Whether the train state holds a reference copy of the params (the objective compares the policy with its
  starting params), except under LoRA, whose reference is the frozen base with the adapters off
  (train_step.reference_params); a teacher (objective=distill) always."""
  if config.objective in teacher.TEACHER_OBJECTIVES:
    return teacher.has_teacher(config)
  return config.objective in REFERENCE_OBJECTIVES and not lora.enabled(config)


def for_inference(config: Config) -> Config:
  """The config of the model that decodes or scores: without multi-token-prediction modules, which only
  train (a checkpoint's MTP parameters are then simply not read)."""
  return config.replace(mtp_num_layers=0) if config.mtp_num_layers else config


def param_spec(config: Config, mesh: Mesh | None = None, plan: Plan | None = None) -> ParamSpec:
  """The model's graphdef and abstract parameters; with a mesh, also where each parameter lives. `plan`:
  the run plan the model is built with (default: planner.build(config, mesh)).

  The model is only traced (nnx.eval_shape): no parameter is allocated, so this is cheap for any size.
  """
  plan = planner.build(config, mesh) if plan is None else plan
  model = nnx.eval_shape(lambda: build_model(config, 0, plan))
  graphdef, abstract = nnx.split(model, nnx.Param)
  partition = Partition(lora.trainable_filter(config))
  if mesh is None:
    return ParamSpec(graphdef, abstract, None, plan, partition)
  shardings = _shardings(abstract, config, mesh)
  return ParamSpec(graphdef, _with_shardings(abstract, shardings), shardings, plan, partition)


# XLA:CPU spends most of the init program's compile time in LLVM's heaviest optimisation passes over the
# random-number kernels (threefry, erf_inv), for a program that runs once: level 1 compiles it about 3x
# faster (benchmarks/README.md; 0.8 vs 1.5 s for the quick-start state on jax 0.12) and gives the same
# values (train_test checks them against a plain jit: bit-identical but for a few ulp in some MoE
# router values on jax 0.12). Other platforms keep their defaults: nothing was measured or checked there.
INIT_COMPILER_OPTIONS = {"cpu": {"xla_backend_optimization_level": 1}}


def _jit_init(init, shardings):
  """jax.jit(init, out_shardings=shardings), with INIT_COMPILER_OPTIONS for the shardings' platform."""
  leaves = jax.tree.leaves(shardings)
  platform = next(iter(leaves[0].device_set)).platform if leaves else jax.default_backend()
  return jax.jit(init, out_shardings=shardings, compiler_options=INIT_COMPILER_OPTIONS.get(platform))


def _optimizer_start(tx: optax.GradientTransformation, spec: StateSpec, params: nnx.State) -> tuple:
  """(step 0, the optimizer's initial state of params' trainable part): a first state's part that no checkpoint
  of params holds; traced inside the caller's init program."""
  return jnp.zeros((), jnp.int32), tx.init(spec.partition.trainable(params))


def lora_state_around(config: Config, tx: optax.GradientTransformation, spec: StateSpec, base: nnx.State) -> TrainState:
  """A first LoRA TrainState on a base read from a checkpoint: fresh adapters (init_weights_seed, the values
  init_state draws for them) and their optimizer state. The program builds the whole model but returns the
  adapters alone, so XLA drops the base's random init: no second copy of the base at the start's peak."""
  adapters = jax.tree.map(lambda a: a.sharding, spec.partition.trainable(spec.abstract.params))

  def init():
    params = _model_params(config, config.init_weights_seed, spec.plan)
    return spec.partition.trainable(params), *_optimizer_start(tx, spec, params)

  trainable, step, opt_state = _jit_init(init, (adapters, spec.shardings.step, spec.shardings.opt_state))()
  return TrainState(step=step, params=spec.partition.combine(trainable, base), opt_state=opt_state, reference=None)


def state_around(tx: optax.GradientTransformation, spec: StateSpec, params: nnx.State) -> TrainState:
  """A first TrainState around parameters read from a checkpoint (load_parameters_path): step 0 and the
  optimizer's initial state. No random parameters are made only to be replaced: init_state's program, whose
  compile is mostly the random-number kernels, its run, and a second copy of the parameters at the peak. The
  reference, for an objective that keeps one, is the caller's (checkpointing.with_reference)."""
  start = functools.partial(_optimizer_start, tx, spec)
  step, opt_state = _jit_init(start, (spec.shardings.step, spec.shardings.opt_state))(params)
  return TrainState(step=step, params=params, opt_state=opt_state, reference=None)


def init_params(config: Config, spec: ParamSpec) -> nnx.State:
  """Random parameters (init_weights_seed) initialised straight into spec.shardings."""
  return _jit_init(lambda: _model_params(config, config.init_weights_seed, spec.plan), spec.shardings)()


def state_spec(config: Config, tx: optax.GradientTransformation, mesh: Mesh, plan: Plan | None = None) -> StateSpec:
  """Shapes, dtypes and shardings of the whole train state (param_spec + the optimizer's state)."""
  params = param_spec(config, mesh, plan)
  trainable = params.partition.trainable(params.abstract)  # LoRA: adapters only
  opt_state = jax.eval_shape(tx.init, trainable)
  opt_shardings = _shardings(opt_state, config, mesh)
  step_sharding = _shardings(jax.ShapeDtypeStruct((), jnp.int32), config, mesh)
  teach = teacher.of(config)
  reference = param_spec(teach.config, mesh) if teach else params if keeps_reference(config) else None
  ref_shardings, ref_abstract = (reference.shardings, reference.abstract) if reference else (None, None)
  shardings = TrainState(step_sharding, params.shardings, opt_shardings, ref_shardings)
  abstract = TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32, sharding=step_sharding),
    params=params.abstract,
    opt_state=_with_shardings(opt_state, opt_shardings),
    reference=ref_abstract,
  )
  num_params = sum(x.size for x in jax.tree.leaves(params.abstract))
  num_trainable = sum(x.size for x in jax.tree.leaves(trainable))
  return StateSpec(
    params.graphdef, abstract, shardings, num_params, num_trainable, params.plan, params.partition, teach
  )


def init_state(config: Config, tx: optax.GradientTransformation, spec: StateSpec) -> TrainState:
  """Initialise directly into the sharded layout: each device computes only its own shards. A teacher
  (spec.teacher) is not made here: its reference is None until checkpointing reads it."""
  copy = keeps_reference(config) and spec.teacher is None

  def init() -> TrainState:
    params = _model_params(config, config.init_weights_seed, spec.plan)
    step, opt_state = _optimizer_start(tx, spec, params)
    reference = jax.tree.map(jnp.copy, params) if copy else None
    return TrainState(step=step, params=params, opt_state=opt_state, reference=reference)

  return _jit_init(init, spec.shardings if spec.teacher is None else spec.shardings.replace(reference=None))()
