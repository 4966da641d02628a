"""The run plan's types: one frozen object that says how this run executes. The builder (MaxText/planner.py,
above the model families) makes it once from the config, the mesh and the target platform, before anything
is traced; the layers receive it and read its decisions. This module imports nothing of MaxText above
parallel/, so every layer can name these types.

What a plan holds (planner.py decides it in this order):
1. the target platform and the mesh axes of each activation axis (`Axes`);
2. the attention kernel and its context split (`AttentionPlan`), also for lengths other than the training one
   and for rows with images;
3. the pipeline schedule (`PipelinePlan`, `Schedule`) and the MoE dispatch (`MoePlan`);
4. the loss's vocab tiling (`LossPlan`), the remat policy, the TPU layout constraints, the activation pieces.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax

from MaxText.parallel import kernels

AUTO_TILE_BYTES = 256 * 2**20  # num_vocab_tiling=-1: float32 logits per device per piece, at most


def fewest_parts(size: int, total_bytes: float, limit: int) -> int:
  """The fewest parts, dividing `size`, of at most `limit` bytes each (`size` when none is that small): the
  loss's vocab tiling here, the activation pieces (planner.py)."""
  return next((n for n in range(1, size + 1) if size % n == 0 and total_bytes / n <= limit), size)


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
  length: int = 0  # max_target_length: the length `kernel` and `image_chunk` are for
  image_chunk: int = 0  # rows with images at `length`: dot_product in query blocks of this many (0: whole)

  def kernel_for(self, length: int) -> str:
    """The kernel for a sequence of `length` tokens: `kernel` at the training length; for another (a caller
    scoring other lengths) autoselected falls back to dot_product where a fused kernel cannot take it."""
    if length == self.length:
      return self.kernel
    return kernels.choose(self.requested, self.platform, self.context_shards, length, self.soft_cap, self.sinks)[0]

  def image_chunk_for(self, length: int) -> int:
    """Rows with images (bidirectional image blocks) run dot_product, in query blocks of attention_query_chunk
    where it divides `length`; 0: the whole sequence at once."""
    if length == self.length:
      return self.image_chunk
    return self.query_chunk if 0 < self.query_chunk < length and length % self.query_chunk == 0 else 0


class Schedule(NamedTuple):
  """How a pipelined stack runs: S stages, M microbatches, R repeats (circular); layers/pipeline.py runs it."""

  stages: int
  microbatches: int
  repeats: int

  @property
  def iterations(self) -> int:
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble(self) -> float:
    """The fraction of stage-iterations that compute nothing useful: (S - 1) / (M*R + S - 1)."""
    return (self.stages - 1) / self.iterations


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
class LossPlan:
  """The loss's vocab tiling: the sequence cut into pieces whose float32 logits [B, T/tiles, V] are made one at
  a time. num_vocab_tiling, or for -1 the fewest pieces (dividing the length) of at most AUTO_TILE_BYTES of
  logits per device, the batch split over the data shards: 1 for small models, where the extra matmul would
  cost more than the memory is worth, 4 for llama2-7b at batch 4 x 2048, 16 for llama3.1-70b at 2 x 4096."""

  tiles: int  # for the training batch: `rows` x `length`
  rows: int  # the rows one forward pass of training takes (global batch / gradient_accumulation_steps)
  length: int  # max_target_length
  requested: int  # num_vocab_tiling (-1: auto)
  vocab_size: int
  data_shards: int  # devices the batch splits over

  def tiles_for(self, batch: int, length: int) -> int:
    """The tiles for a batch of `batch` rows of `length` tokens (eval, DPO pairs, GRPO scoring, micro-batches)."""
    if self.requested > 0:
      return self.requested
    per_device = max(batch // self.data_shards, 1) * length * self.vocab_size * 4
    return fewest_parts(length, per_device, AUTO_TILE_BYTES)


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
  loss: LossPlan
  decoding: bool = False  # built for decode.py: no training kernel or schedule
  mlp_pieces: int = 1  # dense MLPs in this many sequence pieces (planner.Pieces)
  dropout_rate: float = 0.0  # training: dropout after attention and MLP blocks (dropout_rate; 0 without enable_dropout)
  kv_cache_quant: str = ""  # decoding: the KV cache's storage (kv_quant_dtype under quantize_kvcache); "": dtype

  @property
  def platform(self) -> str:
    return self.attention.platform

  @property
  def data_shards(self) -> int:
    """Devices along the batch's mesh axes (1 without a mesh)."""
    return 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in self.data_axes if a in self.mesh.shape)
