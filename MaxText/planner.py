"""The run plan's builder: `build(config, mesh)` decides once, before anything is traced, how this run
executes, and returns the frozen `Plan` (parallel/plan.py) that the model is built with. It sits above the
model families (it asks a family for its layer stacks); the plan's types sit at the bottom.

Decided here, in this order (later decisions read earlier ones):
1. the target platform: the mesh's devices (a TPU topology when compiling ahead of time on a CPU);
2. the mesh axes of each activation axis, from base.yml's logical_axis_rules: everything per-shard code
   needs (attention kernels, context parallelism, MoE dispatch, the pipeline's stage axis);
3. context parallelism (the sequence axes), before the kernel: autoselected attention runs dot_product
   per shard when the sequence is split;
4. the attention kernel, with the reason for it, and the kernel of rows with images;
5. the pipeline schedule and which units of each layer stack it runs;
6. the MoE dispatch, the loss's vocab tiling, the remat policy and the TPU layout constraints;
7. the activation pieces (`Pieces`): how many parts of the batch or sequence the flash call and the dense
   MLP each take in turn, so that one layer's backward holds less at a time.
Each step raises ConfigError for a configuration it cannot run, so a bad layout fails before compiling; so do
the family's own checks (models.problem) and LoRA's targets (lora.target_problem).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from MaxText import config_checks, models, sharding
from MaxText.config import Config
from MaxText.errors import ConfigError
from MaxText.layers import lora, vision
from MaxText.layers.axes import EXPERT_EMBED_AXES, HEAD_AXES, KV_HEAD_AXES, MLP_AXES
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.pipeline import STAGE_AXES
from MaxText.parallel.kernels import LANES, choose
from MaxText.parallel.plan import AttentionPlan, Axes, LossPlan, MoePlan, PipelinePlan, Plan, Schedule, fewest_parts

Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh | None


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


def target_platform(mesh: Mesh) -> str:
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


def _size(mesh, names: Sequence[str]) -> int:
  return math.prod(mesh.shape[a] for a in names) if mesh is not None else 1


def _check_kernel(config: Config, kernel: str, platform: str, shards: int) -> None:
  """The kernel can run here: on this platform, at max_target_length, with the sinks and the context split."""
  length, cap = config.max_target_length, config.attn_logits_soft_cap
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


def _attention(config: Config, platform: str, axes: Axes, mesh) -> AttentionPlan:
  length, cap = config.max_target_length, config.attn_logits_soft_cap
  shards = _size(mesh, axes.length)
  kernel, reason = choose(config.attention, platform, shards, length, cap, config.attention_sink)
  _check_kernel(config, kernel, platform, shards)
  # The fused kernels see the whole sequence (gathered by XLA); only dot_product runs context-parallel.
  shards = shards if kernel == "dot_product" else 1
  multiple = 2 * shards if config.context_parallel_load_balance else shards
  if shards > 1 and length % multiple:
    raise ConfigError(
      f"context parallelism splits the sequence into {shards} shards"
      f"{' of 2 chunks each (context_parallel_load_balance)' if multiple > shards else ''}: "
      f"max_target_length={length} must be a multiple of {multiple}"
    )
  balanced = config.context_parallel_load_balance and shards > 1
  if balanced and config.use_multimodal:  # the balanced layout would cut through the images' blocks
    raise ConfigError(
      "images with load-balanced context parallelism are not supported; set context_parallel_load_balance=false"
    )
  chunk = config.attention_query_chunk
  return AttentionPlan(
    kernel=kernel, reason=reason, requested=config.attention, platform=platform, soft_cap=cap, query_chunk=chunk,
    interpret=platform != "tpu", context_shards=shards, load_balanced=balanced, sinks=config.attention_sink,
    length=length, image_chunk=chunk if 0 < chunk < length and length % chunk == 0 else 0,
  )  # fmt: skip


def _decoding_attention(config: Config, platform: str) -> AttentionPlan:
  return AttentionPlan(
    kernel="dot_product", reason="decoding attends over the KV cache", requested="dot_product", platform=platform,
    soft_cap=config.attn_logits_soft_cap, query_chunk=0, interpret=platform != "tpu", context_shards=1,
    load_balanced=False, length=config.max_target_length,
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


def _loss(config: Config, mesh, data_axes: tuple[str, ...]) -> LossPlan:
  """The loss's vocab tiling, decided for the rows one training forward pass takes (the global batch over
  gradient_accumulation_steps) at max_target_length; LossPlan.tiles_for serves other shapes."""
  devices = math.prod(mesh.shape.values()) if mesh is not None else 1
  rows = max(int(config.per_device_batch_size * devices) // config.gradient_accumulation_steps, 1)
  shards = _size(mesh, [a for a in data_axes if a in mesh.shape]) if mesh is not None else 1
  loss = LossPlan(0, rows, config.max_target_length, config.num_vocab_tiling, config.vocab_size, shards)
  return dataclasses.replace(loss, tiles=loss.tiles_for(rows, loss.length))


def build(config: Config, mesh: Mesh = None, decoding: bool = False) -> Plan:
  """The plan for `config` on `mesh` (None: one device, the default backend). Raises ConfigError for what
  cannot run, before anything is compiled. `decoding`: the model only decodes (prefill and steps attend over
  the KV cache with dot_product, unpipelined), so no training kernel or schedule is chosen or checked."""
  if problem := models.problem(config):
    raise ConfigError(problem)
  family = models.REGISTRY[config.decoder_block]
  abstract = getattr(mesh, "abstract_mesh", mesh)
  if abstract is not None:  # a named key, not an XLA error when the parameters are placed
    config_checks.check_divisibility(config, dict(abstract.shape))
  platform = target_platform(abstract)
  rules, data_axes = tuple(sharding.axis_rules(config)), sharding.data_axes(config)
  axes = activation_axes(abstract, rules)
  model_config = ModelConfig.from_config(config)
  stacks = family.stacks(model_config)
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
    data_axes=data_axes,
    attention=dataclasses.replace(attention, batch_pieces=pieces.flash),
    pipeline=pipeline,
    moe=moe,
    remat_policy=config.remat_policy,
    keep_lanes=platform == "tpu" and abstract is not None,
    loss=_loss(config, abstract, data_axes),
    decoding=decoding,
    mlp_pieces=pieces.mlp,
    dropout_rate=config.dropout_rate if config.enable_dropout else 0.0,
    kv_cache_quant=config.kv_quant_dtype if config.quantize_kvcache else "",
  )
  if problem := lora.target_problem(config, model_config, stacks, family.vision or vision.VisionEncoder, plan):
    raise ConfigError(problem)
  return plan


def _pieces(config: Config, mesh, axes: Axes, attention: AttentionPlan, pipeline: PipelinePlan | None) -> Pieces:
  """flash_pieces and mlp_pieces, -1 resolved from the per-device workspace sizes (Pieces)."""
  devices = math.prod(mesh.shape.values()) if mesh is not None else 1
  length = config.max_target_length
  local_batch = max(int(config.per_device_batch_size * devices) // max(_size(mesh, axes.batch), 1), 1)
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
    heads = max(config.num_query_heads // max(_size(mesh, axes.heads), 1), 1)
    residual = local_batch * heads * length * LANES * 4  # the float32 log-sum-exp, 128 lanes wide
    large = attention.kernel == "flash" and residual > AUTO_FLASH_WHOLE_BYTES
    flash = fewest_parts(local_batch, residual, AUTO_FLASH_PIECE_BYTES) if large else 1
  if mlp == -1:
    hidden = local_batch * length * config.mlp_dim // max(_size(mesh, axes.mlp), 1)
    hidden *= jax.numpy.dtype(config.dtype).itemsize  # bytes per device
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
  if config.use_multimodal and not plan.decoding and models.REGISTRY[config.decoder_block].splice is None:
    blocks = f"in query blocks of {a.image_chunk}" if a.image_chunk else "over the whole sequence"
    lines.append(f"rows with images: dot_product {blocks} (each image's tokens attend both ways)")
  if plan.pipeline is not None:
    s = plan.pipeline.schedule
    lines.append(
      f"pipeline: {s.stages} stages x {s.repeats} repeats, {s.microbatches} microbatches, "
      f"{s.iterations} iterations, bubble {s.bubble:.1%} (idle stage-iterations)"
    )
  if plan.moe is not None:
    m = plan.moe
    how = "dropless" if not m.capacity_factor else f"capacity {m.capacity_factor} per {m.capacity_group}"
    moves = f"all-to-all over {plan.axes.experts}" if plan.axes.experts else "no expert axis"
    lines.append(f"moe: {how}, {moves}, {'ragged' if m.ragged else 'padded dense'} dispatch")
  if plan.decoding:
    lines.append(f"data axes {plan.data_axes}")
  else:
    loss = plan.loss
    how = "num_vocab_tiling" if loss.requested > 0 else "auto, by logits bytes per device"
    tiles = f"{loss.tiles} for {loss.rows} x {loss.length} ({how})"
    lines.append(f"loss: vocab tiling {tiles}; remat: {plan.remat_policy}; data axes {plan.data_axes}")
    if plan.mlp_pieces > 1 or a.batch_pieces > 1:
      lines.append(f"pieces: flash call in {a.batch_pieces} batch parts, dense MLP in {plan.mlp_pieces} sequence parts")
  if plan.keep_lanes:
    lines.append("layout: TPU lane-friendly layouts for narrow weight shards (sharding.lane_layout)")
  return lines
