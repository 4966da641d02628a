"""The run plan: one frozen object that says how this run executes, built once from the config, the mesh
and the target platform before anything is traced (parallel/__init__.py).

Decided here, in this order (later decisions read earlier ones):
1. the target platform: the mesh's devices (a TPU topology when compiling ahead of time on a CPU);
2. the mesh axes of each activation axis, from base.yml's logical_axis_rules: everything per-shard code
   needs (attention kernels, context parallelism, MoE dispatch, the pipeline's stage axis);
3. context parallelism (the sequence axes), before the kernel: autoselected attention runs dot_product
   per shard when the sequence is split;
4. the attention kernel, with the reason for it;
5. the pipeline schedule and which units of each layer stack it runs;
6. the MoE dispatch, the loss's vocab tiling, the remat policy and the TPU layout constraints;
7. the activation pieces (`Pieces`): how many parts of the batch or sequence the flash call and the dense
   MLP each take in turn, so that one layer's backward holds less at a time.
Each step raises ConfigError for a configuration it cannot run, so a bad layout fails before compiling.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from MaxText import config_checks, models, sharding
from MaxText.config import Config, ConfigError
from MaxText.layers import lora, vision
from MaxText.layers.attention_kernels import LANES
from MaxText.layers.axes import EXPERT_EMBED_AXES, HEAD_AXES, KV_HEAD_AXES, MLP_AXES
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.pipeline import STAGE_AXES, Schedule


@dataclasses.dataclass(frozen=True)
class Axes:
  """The mesh axes (of size > 1) that the logical rules give each activation axis that per-shard code splits."""

  batch: tuple[str, ...] = ()  # activation_batch
  heads: tuple[str, ...] = ()  # activation_heads
  kv_heads: tuple[str, ...] = ()  # activation_kv_heads
  length: tuple[str, ...] = ()  # activation_length: context parallelism
  experts: tuple[str, ...] = ()  # activation_exp: expert parallelism
  mlp: tuple[str, ...] = ()  # activation_mlp
  stage: tuple[str, ...] = ()  # activation_stage: pipeline stages


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """Which kernel trains attention, and how it is split."""

  kernel: str  # dot_product | flash | cudnn_flash_te, at the training length
  reason: str
  requested: str  # config.attention
  platform: str
  soft_cap: float  # attn_logits_soft_cap
  query_chunk: int  # attention_query_chunk (dot_product)
  interpret: bool  # flash off TPU: Pallas' interpreter (tests)
  context_shards: int  # 1: the sequence is whole per device
  load_balanced: bool  # context parallelism in the balanced chunk order (context_parallel.balance)
  batch_pieces: int = 1  # flash: the kernel called on this many parts of each shard's batch in turn (Pieces)
  sinks: bool = False  # attention_sink: only dot_product takes the sink logits

  def kernel_for(self, length: int) -> str:
    """The kernel for a sequence of `length` tokens (a caller scoring a length other than the training one:
    autoselected falls back to dot_product where a fused kernel cannot take it)."""
    return _kernel(self.requested, self.platform, self.context_shards, length, self.soft_cap, self.sinks)[0]


@dataclasses.dataclass(frozen=True)
class Pieces:
  """Activation pieces (flash_pieces, mlp_pieces): how many parts a layer's two largest backward workspaces
  are made in, one part at a time. Exact (each token's result is computed as whole), and no extra FLOPs
  under remat_policy=full: the layer's recompute skips the MLP (its backward needs only its input), and each
  MLP piece's backward remakes that piece's hidden activations. -1 (auto) makes pieces only where a whole
  workspace would be large per device (the AUTO_* sizes below): none for llama2-7b at 4 x 2048 per device on
  v5e-256; at 16 x 2048, 4 flash parts and 16 MLP parts of 128 tokens (12.99 -> 11.50 GiB per chip)."""

  flash: int  # the flash call on this many parts of each shard's batch (its log-sum-exp is written 128 lanes wide)
  mlp: int  # dense MLPs on this many parts of the sequence, each rematerialised on its own


# mlp_pieces=-1: a dense MLP whose hidden activations [B, T, F] pass AUTO_MLP_WHOLE_BYTES per device runs in
# parts of at most AUTO_MLP_PIECE_BYTES (small ones stay whole: a loop is not worth it there).
AUTO_MLP_WHOLE_BYTES, AUTO_MLP_PIECE_BYTES = 256 * 2**20, 64 * 2**20
# flash_pieces=-1: where the kernel's lane-padded log-sum-exp passes AUTO_FLASH_WHOLE_BYTES per device, calls
# of at most AUTO_FLASH_PIECE_BYTES of it (at 256 MiB, mixtral-8x7b on v5p-128, two calls cost 0.11 GiB more).
AUTO_FLASH_WHOLE_BYTES, AUTO_FLASH_PIECE_BYTES = 256 * 2**20, 128 * 2**20


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  schedule: Schedule  # stages, microbatches, repeats
  units: tuple[tuple[str, int], ...]  # per layer stack (by name): how many of its first units run pipelined

  def units_of(self, stack: str) -> int:
    return dict(self.units).get(stack, 0)


@dataclasses.dataclass(frozen=True)
class MoePlan:
  ragged: bool  # dropless on TPU/GPU: ragged all-to-all and ragged_dot; XLA:CPU pads dense blocks
  vary_for_quantization: bool  # quantized expert matmuls need their operands marked varying (moe.varying)
  capacity_factor: float
  capacity_group: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """How this run executes. Frozen and hashable: the model holds it (its graphdef does) and jit keys on it."""

  mesh: jax.sharding.AbstractMesh | None  # None: one device, no per-shard code at all
  rules: tuple[tuple[str, Any], ...]  # logical axis rules (sharding.axis_rules)
  axes: Axes
  data_axes: tuple[str, ...]  # the batch's mesh axes (data_sharding)
  attention: AttentionPlan
  pipeline: PipelinePlan | None  # None: one stage
  moe: MoePlan | None  # None: no experts
  remat_policy: str
  keep_lanes: bool  # TPU: weights and gradients keep their larger dim minor (sharding.lane_layout)
  decoding: bool = False  # built for decode.py: no training kernel, schedule or loss
  mlp_pieces: int = 1  # dense MLPs in this many sequence pieces (Pieces)
  dropout_rate: float = 0.0  # training: dropout after attention and MLP blocks (dropout_rate; 0 without enable_dropout)
  kv_cache_quant: str = ""  # decoding: the KV cache's storage (kv_quant_dtype under quantize_kvcache); "": dtype

  @property
  def platform(self) -> str:
    return self.attention.platform

  @property
  def data_shards(self) -> int:
    """Devices along the batch's mesh axes (1 without a mesh)."""
    return 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in self.data_axes if a in self.mesh.shape)


def target_platform(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None) -> str:
  """The platform the program is built for: the mesh's devices', else JAX's default backend."""
  abstract = getattr(mesh, "abstract_mesh", mesh)
  device = None if abstract is None or abstract.empty else abstract.abstract_device
  platform = device.platform if device is not None else jax.default_backend()
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _mesh_axes(logical: str, names: tuple[str, ...], mesh, rules) -> tuple[str, ...]:
  spec = nn.logical_to_mesh_axes(names, rules)
  entry = spec[names.index(logical)] if spec is not None else None
  axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
  return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def activation_axes(mesh: jax.sharding.AbstractMesh | None, rules) -> Axes:
  if mesh is None:
    return Axes()
  find = lambda logical, names: _mesh_axes(logical, names, mesh, rules)  # noqa: E731
  return Axes(
    batch=find("activation_batch", HEAD_AXES),
    heads=find("activation_heads", HEAD_AXES),
    kv_heads=find("activation_kv_heads", KV_HEAD_AXES),
    length=find("activation_length", HEAD_AXES),
    experts=find("activation_exp", EXPERT_EMBED_AXES),
    mlp=find("activation_mlp", MLP_AXES),
    stage=find("activation_stage", STAGE_AXES),
  )


def _kernel(
  requested: str, platform: str, context_shards: int, length: int, soft_cap: float, sinks: bool = False
) -> tuple[str, str]:
  """(kernel, why): config.attention, with autoselected resolved for the platform: flash (Pallas splash) on
  TPU, cuDNN on NVIDIA GPUs, dot_product elsewhere or where the fused kernel cannot take the shapes (or the
  attention sinks)."""
  if requested != "autoselected":
    return requested, f"attention={requested} in the config"
  if sinks:
    return "dot_product", "autoselected: attention_sink, which only dot_product takes"
  if context_shards > 1:  # the kernels see a whole sequence; dot_product runs per context shard
    return "dot_product", f"autoselected: context parallelism over {context_shards} shards runs dot_product"
  if platform == "tpu" and length % LANES == 0:
    return "flash", "autoselected: TPU, length a multiple of 128 (Pallas splash)"
  if platform == "tpu":
    return "dot_product", f"autoselected: TPU, but length {length} is not a multiple of {LANES} for flash"
  if platform == "gpu" and not soft_cap:
    return "cudnn_flash_te", "autoselected: NVIDIA GPU, no attention soft-cap (cuDNN flash)"
  if platform == "gpu":
    return "dot_product", "autoselected: GPU with attn_logits_soft_cap, which cuDNN does not take"
  return "dot_product", f"autoselected: no fused kernel on {platform}"


def _attention(config: Config, platform: str, axes: Axes, mesh) -> AttentionPlan:
  length, cap = config.max_target_length, config.attn_logits_soft_cap
  shards = math.prod(mesh.shape[a] for a in axes.length) if mesh is not None else 1
  kernel, reason = _kernel(config.attention, platform, shards, length, cap, config.attention_sink)
  if config.attention_sink and (kernel != "dot_product" or shards > 1):
    raise ConfigError(
      f"attention_sink=true runs with attention=dot_product (or autoselected) on whole sequences; got "
      f"attention={kernel} over {shards} context shard(s): set attention=dot_product and no context parallelism"
    )
  if kernel == "flash" and platform == "gpu":
    raise ConfigError("attention=flash is the TPU (Pallas splash) kernel; on NVIDIA GPUs use attention=cudnn_flash_te")
  if kernel == "cudnn_flash_te" and platform != "gpu":
    raise ConfigError(
      f"attention=cudnn_flash_te needs NVIDIA GPUs (cuDNN); JAX runs on {platform}. Use attention=dot_product here"
    )
  if kernel == "flash" and length % LANES:
    raise ConfigError(
      f"attention=flash needs max_target_length to be a multiple of {LANES}; got {length}. Set max_target_length "
      f"to a multiple of {LANES} (e.g. {-(-length // LANES) * LANES}) or use attention=dot_product"
    )
  if kernel == "cudnn_flash_te" and cap:
    raise ConfigError("attention=cudnn_flash_te does not support attn_logits_soft_cap; use attention=dot_product")
  # The fused kernels see the whole sequence (gathered by XLA); only dot_product runs context-parallel.
  shards = shards if kernel == "dot_product" else 1
  multiple = 2 * shards if config.context_parallel_load_balance else shards
  if shards > 1 and length % multiple:
    raise ConfigError(
      f"context parallelism splits the sequence into {shards} shards"
      f"{' of 2 chunks each (context_parallel_load_balance)' if multiple > shards else ''}: "
      f"max_target_length={length} must be a multiple of {multiple}"
    )
  return AttentionPlan(
    kernel=kernel, reason=reason, requested=config.attention, platform=platform, soft_cap=cap,
    query_chunk=config.attention_query_chunk, interpret=platform != "tpu", context_shards=shards,
    load_balanced=config.context_parallel_load_balance and shards > 1, sinks=config.attention_sink,
  )  # fmt: skip


def _decoding_attention(config: Config, platform: str) -> AttentionPlan:
  return AttentionPlan(
    kernel="dot_product", reason="decoding attends over the KV cache", requested="dot_product", platform=platform,
    soft_cap=config.attn_logits_soft_cap, query_chunk=0, interpret=platform != "tpu", context_shards=1,
    load_balanced=False,
  )  # fmt: skip


def schedule(config: Config) -> Schedule | None:
  """The pipeline schedule, or None when there is one stage (no pipelining)."""
  stages = config_checks.pipeline_stages(config)
  if stages <= 1:
    return None
  micro = config.num_pipeline_microbatches
  return Schedule(stages, stages if micro == -1 else micro, config.num_pipeline_repeats)


def _pipeline(config: Config, stacks: Sequence[Any]) -> PipelinePlan | None:
  """Units of each stack that run pipelined: all of them, or with pipeline_parallel_layers=N those among
  the model's first N layers; the remaining units of a stack run after, unpipelined."""
  sched = schedule(config)
  if sched is None:
    return None
  budget = config.num_decoder_layers if config.pipeline_parallel_layers == -1 else config.pipeline_parallel_layers
  split = sched.stages * sched.repeats
  units = []
  for stack in stacks:
    n = min(stack.repeats, max(budget, 0) // stack.layers_per_unit)
    budget -= stack.repeats * stack.layers_per_unit
    if n % split:
      per_unit = f" of {stack.layers_per_unit} layers" if stack.layers_per_unit > 1 else ""
      raise ConfigError(
        f"pipelining: {n} units{per_unit} of stack {stack.name!r} do not split into {sched.stages} stages x "
        f"num_pipeline_repeats={sched.repeats}; change the layer count, the stages or the repeats, or set "
        "pipeline_parallel_layers to a layer count that splits (the layers after it run unpipelined)"
      )
    units.append((stack.name, n))
  if not any(n for _, n in units):
    raise ConfigError(f"pipelining: {sched.stages} stages but no layers to pipeline; raise pipeline_parallel_layers")
  return PipelinePlan(sched, tuple(units))


def _check_family(config: Config) -> models.Family:
  if config.decoder_block not in models.REGISTRY:
    raise ConfigError(
      f"Unknown decoder_block {config.decoder_block!r}; choose one of {', '.join(sorted(models.REGISTRY))}"
    )
  family = models.REGISTRY[config.decoder_block]
  if family.learned_positions and config.trainable_position_size <= 0:
    raise ConfigError(f"decoder_block={config.decoder_block} needs trainable_position_size > 0")
  if config.decoder_block == "qwen3next":  # the gated DeltaNet (layers/gated_deltanet.py)
    if config.full_attention_interval < 1 or config.linear_num_value_heads % max(config.linear_num_key_heads, 1):
      raise ConfigError(
        f"qwen3next needs full_attention_interval >= 1 and linear_num_value_heads a multiple of "
        f"linear_num_key_heads; got {config.full_attention_interval}, {config.linear_num_value_heads}, "
        f"{config.linear_num_key_heads}"
      )
    if config.ici_context_parallelism * config.dcn_context_parallelism > 1:
      raise ConfigError("qwen3next: the gated DeltaNet runs over whole sequences; set ici/dcn_context_parallelism=1")
  if config.mtp_num_layers and family.mtp_layer is None:
    raise ConfigError(
      f"mtp_num_layers={config.mtp_num_layers} is not available for decoder_block={config.decoder_block} "
      "(multi-token prediction: deepseek and the llama2 family); set mtp_num_layers=0"
    )
  return family


def _check_lora_targets(config: Config, stacks: Sequence[Any], plan: Plan) -> None:
  """lora_target_modules must match a projection of every layer kind (Qwix matches module paths with
  re.fullmatch), and lora_vision_target_modules one of a trained vision tower, checked on abstract layers:
  nothing is allocated."""
  if not lora.enabled(config):
    return
  model_config = ModelConfig.from_config(config)
  for stack in stacks:
    with nnx.use_eager_sharding(False):  # as models.build: shapes only, no placement
      unit = nnx.eval_shape(lambda s=stack: s.make(model_config, rngs=nnx.Rngs(0), plan=plan))
    paths = lora.kernel_paths(unit)
    if not any(re.fullmatch(config.lora_target_modules, p) for p in paths):
      raise ConfigError(
        f"lora_target_modules={config.lora_target_modules!r} matches no projection of a decoder layer; "
        f"their paths are: {', '.join(paths)}"
      )
  if model_config.vision is not None and not config.freeze_vision_encoder:  # the tower gets adapters too
    family = models.family(model_config)
    with nnx.use_eager_sharding(False):
      tower = nnx.eval_shape(lambda: (family.vision or vision.VisionEncoder)(model_config, rngs=nnx.Rngs(0)))
    try:
      lora.tower_targets(tower, config.lora_vision_target_modules)
    except ValueError as e:
      raise ConfigError(f"{e} (or set freeze_vision_encoder=true)") from None


def build(
  config: Config, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None, decoding: bool = False
) -> Plan:
  """The plan for `config` on `mesh` (None: one device, the default backend). Raises ConfigError for what
  cannot run, before anything is compiled. `decoding`: the model only decodes (prefill and steps attend over
  the KV cache with dot_product, unpipelined), so no training kernel or schedule is chosen or checked."""
  family = _check_family(config)
  abstract = getattr(mesh, "abstract_mesh", mesh)
  if abstract is not None:  # a named key, not an XLA error when the parameters are placed
    config_checks.check_divisibility(config, dict(abstract.shape))
  platform = target_platform(abstract)
  rules = tuple(sharding.axis_rules(config))
  axes = activation_axes(abstract, rules)
  stacks = family.stacks(ModelConfig.from_config(config))
  moe = None
  if config.num_experts > 1:
    moe = MoePlan(platform != "cpu", bool(config.quantization), config.capacity_factor, config.capacity_group)
  attention = _decoding_attention(config, platform) if decoding else _attention(config, platform, axes, abstract)
  pipeline = None if decoding else _pipeline(config, stacks)
  pieces = Pieces(1, 1) if decoding else _pieces(config, abstract, axes, attention, pipeline)
  plan = Plan(
    mesh=abstract,
    rules=rules,
    axes=axes,
    data_axes=sharding.data_axes(config),
    attention=dataclasses.replace(attention, batch_pieces=pieces.flash),
    pipeline=pipeline,
    moe=moe,
    remat_policy=config.remat_policy,
    keep_lanes=platform == "tpu" and abstract is not None,
    decoding=decoding,
    mlp_pieces=pieces.mlp,
    dropout_rate=config.dropout_rate if config.enable_dropout else 0.0,
    kv_cache_quant=config.kv_quant_dtype if config.quantize_kvcache else "",
  )
  _check_lora_targets(config, stacks, plan)
  return plan


def fewest_parts(size: int, total_bytes: float, limit: int) -> int:
  """The fewest parts, dividing `size`, of at most `limit` bytes each (`size` when none is that small): the
  activation pieces here, the loss's vocab tiling (train_step.vocab_tiles)."""
  return next((n for n in range(1, size + 1) if size % n == 0 and total_bytes / n <= limit), size)


def _pieces(config: Config, mesh, axes: Axes, attention: AttentionPlan, pipeline: PipelinePlan | None) -> Pieces:
  """flash_pieces and mlp_pieces, -1 resolved from the per-device workspace sizes (Pieces)."""
  size = lambda names: math.prod(mesh.shape[a] for a in names) if mesh is not None else 1  # noqa: E731
  devices = math.prod(mesh.shape.values()) if mesh is not None else 1
  length = config.max_target_length
  local_batch = max(int(config.per_device_batch_size * devices) // max(size(axes.batch), 1), 1)
  flash, mlp = config.flash_pieces, config.mlp_pieces
  if flash > 1 and attention.kernel != "flash":
    raise ConfigError(f"flash_pieces={flash} splits the flash kernel's call, but attention runs {attention.kernel}")
  if flash > 1 and local_batch % flash:
    raise ConfigError(
      f"flash_pieces={flash} must divide the batch each device's flash call sees ({local_batch} rows); "
      "set a divisor, or -1 (auto)"
    )
  if mlp > 1 and length % mlp:
    raise ConfigError(f"mlp_pieces={mlp} must divide max_target_length={length}; set a divisor, or -1 (auto)")
  if mlp > 1 and (axes.length or pipeline is not None):
    raise ConfigError(
      f"mlp_pieces={mlp} cuts the sequence, which context parallelism or the pipeline already splits; use 1 or -1"
    )
  if flash == -1:
    heads = max(config.num_query_heads // max(size(axes.heads), 1), 1)
    residual = local_batch * heads * length * LANES * 4  # the float32 log-sum-exp, 128 lanes wide
    large = attention.kernel == "flash" and residual > AUTO_FLASH_WHOLE_BYTES
    flash = fewest_parts(local_batch, residual, AUTO_FLASH_PIECE_BYTES) if large else 1
  if mlp == -1:
    hidden = local_batch * length * config.mlp_dim // max(size(axes.mlp), 1) * jax.numpy.dtype(config.dtype).itemsize
    whole = axes.length or pipeline is not None or config.remat_policy != "full"
    mlp = 1 if whole or hidden <= AUTO_MLP_WHOLE_BYTES else fewest_parts(length, hidden, AUTO_MLP_PIECE_BYTES)
  return Pieces(flash=flash, mlp=mlp)


def describe(plan: Plan, config: Config) -> list[str]:
  """The plan in lines for the run header, train_compile's report and decode.py."""
  a = plan.attention
  lines = [f"attention: {a.kernel}, because {a.reason}"]
  if a.context_shards > 1:
    order = "load-balanced chunks" if a.load_balanced else "contiguous"
    lines.append(f"context parallelism: sequence in {a.context_shards} shards over {plan.axes.length} ({order})")
  if plan.pipeline is not None:
    s = plan.pipeline.schedule
    lines.append(
      f"pipeline: {s.stages} stages x {s.repeats} repeats, {s.microbatches} microbatches, "
      f"{s.iterations} iterations, bubble {s.bubble:.1%} (idle stage-iterations)"
    )
  if plan.moe is not None:
    how = (
      "dropless"
      if not plan.moe.capacity_factor
      else f"capacity {plan.moe.capacity_factor} per {plan.moe.capacity_group}"
    )
    moves = f"all-to-all over {plan.axes.experts}" if plan.axes.experts else "no expert axis"
    lines.append(f"moe: {how}, {moves}, {'ragged' if plan.moe.ragged else 'padded dense'} dispatch")
  if plan.decoding:
    lines.append(f"data axes {plan.data_axes}")
  else:
    tiles = "auto (by logits bytes per device)" if config.num_vocab_tiling == -1 else str(config.num_vocab_tiling)
    lines.append(f"loss: vocab tiling {tiles}; remat: {plan.remat_policy}; data axes {plan.data_axes}")
    if plan.mlp_pieces > 1 or a.batch_pieces > 1:
      lines.append(f"pieces: flash call in {a.batch_pieces} batch parts, dense MLP in {plan.mlp_pieces} sequence parts")
  if plan.keep_lanes:
    lines.append("layout: TPU lane-friendly layouts for narrow weight shards (sharding.lane_layout)")
  return lines
