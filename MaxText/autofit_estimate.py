"""Auto-fit's estimates of one candidate layout (autofit.py searches them): bytes per device of a train step
(`estimate`) and seconds per step (`step_time`), from the model's widths, the split's exact state bytes and
what the remat policy keeps (parallel/remat.py).

Cost model (`step_time`): hardware FLOPs (flops.py's model count plus what the remat policy recomputes)
over the chip's peak x auto_fit_mfu, overlapped with the fsdp weight gathers and gradient reduce-scatters
over the chip's ICI bandwidth (ICI_BYTES_PER_S, published per-chip figures); tensor-parallel activation
collectives, expert all-to-alls and host offload transfers are added (not overlapped). Not modelled: DCN.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from MaxText.config import Config
from MaxText.parallel import remat as remat_lib

# Inter-chip interconnect bandwidth per chip, bytes/s (Cloud TPU system-architecture pages: v4 2,400 Gbps,
# v5e 1,600 Gbps, v5p 4,800 Gbps, v6e 3,584 Gbps; H100/H200 NVLink 900 GB/s); keyed by DeviceSpec.name.
ICI_BYTES_PER_S = {
  "TPU v4": 300e9, "TPU v5e": 200e9, "TPU v5p": 600e9, "TPU v6e": 448e9, "H100 SXM": 900e9, "H200": 900e9,
}  # fmt: skip
HOST_BYTES_PER_S = 16e9  # assumed device <-> host link per chip for offloaded activations (PCIe Gen4 x16 / 2)


@dataclasses.dataclass(frozen=True)
class Split:
  """How one slice's chips are divided: fsdp x tensor x expert (ici_* keys)."""

  fsdp: int
  tensor: int
  expert: int

  def overrides(self) -> dict[str, int]:
    return {
      "ici_data_parallelism": 1, "ici_fsdp_parallelism": self.fsdp, "ici_tensor_parallelism": self.tensor,
      "ici_expert_parallelism": self.expert, "ici_pipeline_parallelism": 1,
    }  # fmt: skip

  def __str__(self) -> str:
    parts = [f"fsdp {self.fsdp}"] + [f"{n} {v}" for n, v in (("tensor", self.tensor), ("expert", self.expert)) if v > 1]
    return ", ".join(parts)


class Moe(NamedTuple):
  """The MoE widths the dispatch buffers depend on (layers/moe.py, layers/moe_dispatch.py)."""

  experts: int  # E
  k: int  # routed experts per token
  expert_mlp: int  # F of one routed expert
  shared_mlp: int  # F of the shared experts' MLP (shared_experts x F; 0: none)
  capacity_factor: float  # 0: dropless


class Dims(NamedTuple):
  """The model widths the estimate needs (per token, per layer), from the config."""

  emb: int  # D
  qkv: int  # (N + 2K) * H: query, key and value projection outputs
  context: int  # N * H: attention output before the out projection
  mlp: int  # F of the MLP a token runs (MoE: k experts x their F)
  layers: int
  vocab: int
  length: int  # T
  act_bytes: int  # bytes per activation element (config.dtype)
  moe: Moe | None = None  # None: a dense model


class Facts(NamedTuple):
  """What one split gives every candidate on it, per device."""

  split: Split
  devices: int
  state_bytes: int  # params + optimizer state, exact from the state's shardings
  param_bytes: int  # params alone: the gradients' size (same dtype and sharding)
  layer_weight_bytes: float  # one layer's weights gathered over fsdp, in the compute dtype
  batch_shards: int  # devices along the batch's mesh axes
  flops_per_token: float  # flops.py's training count (6·N + attention)
  matmul_share: dict[str, float]  # share of the layer matmul FLOPs in qkv / out / mlp_in / mlp_out


class Estimate(NamedTuple):
  fixed: float  # bytes: state, gradients, accumulator, gathered weights
  activations: float  # bytes: saved activations, a layer's backward workspace, logits
  total: float


@dataclasses.dataclass(frozen=True)
class Candidate:
  split: Split
  remat: str
  accumulation: int
  batch: int  # per_device_batch_size of the step (accumulation micro-batches of batch / accumulation each)
  estimate: float = 0.0  # bytes
  compiled: float | None = None  # bytes, XLA's total; None: not compiled
  fits: bool | None = None  # None: not compiled
  step_s: float = 0.0

  def key(self) -> tuple[Split, str, int]:
    return (self.split, self.remat, self.accumulation)


def dims(config: Config) -> Dims:
  moe = None
  if config.num_experts > 1:
    f, k = config.moe_mlp_dim, config.num_experts_per_tok
    moe = Moe(config.num_experts, k, f, config.shared_experts * f, config.capacity_factor)
  mlp = moe.k * moe.expert_mlp if moe else config.mlp_dim
  heads, kv = config.num_query_heads, config.num_kv_heads
  itemsize = jax.numpy.dtype(config.dtype).itemsize
  return Dims(
    config.emb_dim, (heads + 2 * kv) * config.head_dim, heads * config.head_dim, mlp, config.num_decoder_layers,
    config.vocab_size, config.max_target_length, itemsize, moe,
  )  # fmt: skip


def tag_elements(d: Dims, tags: tuple[str, ...], tensor: int) -> float:
  """Elements per token of one layer's activations that carry these remat tags (parallel/remat.py: KEEPS,
  OFFLOADS), tensor-split widths /t. "dots" is every matmul output; q, k and v count together."""
  qkv, ctx, mlp_in, out = d.qkv / tensor, d.context / tensor, 2 * d.mlp / tensor, d.emb
  width = {"dots": qkv + out + mlp_in + out, "context": ctx, "out_proj": out, "mlpwo": out}
  return (qkv if set(remat_lib.QKV) <= set(tags) else 0.0) + sum(width[t] for t in tags if t in width)


def saved_per_token(d: Dims, remat: str, tensor: int) -> float:
  """Elements one layer keeps per token for its backward under `remat` (on the chip), tensor-split widths /t.
  The layer input is always kept (the scanned stack's carry); the policies add what they keep (KEEPS)."""
  if remat == "none":  # every intermediate: the matmul outputs, the context, the gated MLP's, norms
    qkv, ctx, mlp_in, out = d.qkv / tensor, d.context / tensor, 2 * d.mlp / tensor, d.emb
    return d.emb + qkv + ctx + 2 * out + 2 * mlp_in + 4 * d.emb
  return d.emb + tag_elements(d, remat_lib.KEEPS[remat], tensor)


# Buffers of one dispatch row live at once in an MoE layer's backward: of width F, the gate and up projections,
# their gated product and its gradient; of width D, the received, sorted, computed and returned rows. Fitted to
# mixtral-8x7b's compiles on v5p-128 (benchmarks/README.md, "Auto-fit"); XLA's buffer report at expert=8,
# batch 4 holds five [131072, 14336] (rows x F) slots and about ten [131072, 4096] (rows x D), not all live at once.
MOE_LIVE_F, MOE_LIVE_D = 4, 4


def dispatch_rows(m: Moe, expert: int) -> float:
  """Rows per token that a device's experts compute on, as the dispatch buffers are sized (not as routed):
  capacity_factor x k slots (at most E); dropless on one shard, the k assignments; dropless over `expert`
  shards, the receive buffer's worst case: each of the ep sources may send a shard min(k, E/ep) rows per
  token (moe_dispatch.dropless), so ep x min(k, E/ep), up to 8x a balanced load for mixtral at expert=8."""
  if m.capacity_factor > 0:
    return min(m.capacity_factor * m.k, m.experts)
  if expert <= 1:
    return m.k
  return expert * min(m.k, m.experts // expert)


def workspace_per_token(d: Dims, split: Split) -> float:
  """Elements per token of one layer's backward workspace. Dense: 0.4 of all its intermediates (fitted to
  llama2-7b on v5e-256: 0.627 GiB per sample compiled, of which the kept layer inputs are 0.5). MoE: the same
  for the layer without its routed experts, plus the dispatch rows' live buffers, which grow with the
  expert axis (dispatch_rows), not with the tokens' k alone."""
  t = split.tensor
  if d.moe is None:
    return 0.4 * saved_per_token(d, "none", t)
  outside = 0.4 * saved_per_token(d._replace(mlp=d.moe.shared_mlp), "none", t)
  rows = dispatch_rows(d.moe, split.expert)
  return outside + rows * (MOE_LIVE_F * d.moe.expert_mlp / t + MOE_LIVE_D * d.emb)


def estimate(d: Dims, f: Facts, remat: str, batch: float, accumulation: int = 1) -> Estimate:
  """Bytes per device of one train step at per_device_batch_size `batch` (the step's), split into
  `accumulation` micro-batches. Fixed: state + gradients (+ an accumulator) + two layers of gathered weights.
  Activations (for one micro-batch): what `remat` saves per layer, one layer's backward workspace
  (workspace_per_token) and the float32 logits and their gradient."""
  rows = batch * f.devices / accumulation / f.batch_shards  # micro-batch rows on each device
  tokens = rows * d.length
  fixed = f.state_bytes + f.param_bytes * (2 if accumulation > 1 else 1) + 2 * f.layer_weight_bytes
  saved = tokens * d.layers * saved_per_token(d, remat, f.split.tensor) * d.act_bytes
  workspace = tokens * workspace_per_token(d, f.split) * d.act_bytes  # the compiles calibrate the rest
  logits = min(tokens * d.vocab / f.split.tensor * 4, 256 * 2**20)  # num_vocab_tiling=-1: <= 256 MiB pieces
  act = saved + workspace + logits
  return Estimate(fixed, act, fixed + act)


def recomputed_share(remat: str, share: dict[str, float]) -> float:
  """Share of the layers' forward matmul FLOPs the backward computes again under `remat`: all but the matmul
  outputs it keeps on the chip or the host (parallel/remat.py: KEEPS, OFFLOADS)."""
  kept = set(remat_lib.KEEPS[remat]) | set(remat_lib.OFFLOADS.get(remat, ()))
  if kept & {"dots", "all"}:
    return 0.0
  groups = {"qkv": set(remat_lib.QKV) <= kept, "out": "out_proj" in kept, "mlp_out": "mlpwo" in kept}
  return 1.0 - sum(share[g] for g, k in groups.items() if k)


def step_time(d: Dims, f: Facts, c: Candidate, peak: float, mfu: float, ici: float) -> float:
  """Estimated seconds per step (the module docstring says what is assumed)."""
  tokens = c.batch * d.length  # per device per step
  matmul_fwd = f.flops_per_token / 3  # forward share of the 6·N + attention count
  hardware = f.flops_per_token * tokens + recomputed_share(c.remat, f.matmul_share) * matmul_fwd * tokens
  compute = hardware / (peak * mfu)
  fsdp = f.split.fsdp
  gathers = 3 if recomputed_share(c.remat, f.matmul_share) else 2  # forward, backward (+ the recompute)
  per_micro = d.layers * f.layer_weight_bytes * (gathers + 2) * (fsdp - 1) / fsdp  # + f32 grad reduce-scatter
  overlapped = per_micro * c.accumulation / ici
  rows = c.batch * f.devices / f.batch_shards
  t = f.split.tensor
  tensor = 8 * d.layers * rows * d.length * d.emb * d.act_bytes * (t - 1) / t / ici  # 2 fwd + 2 bwd, + recompute
  e = f.split.expert
  expert = 4 * d.layers * rows * d.length * d.emb * d.act_bytes * (e - 1) / e / ici if e > 1 else 0.0
  offload = 0.0
  if c.remat in remat_lib.OFFLOADS:
    offloaded = tag_elements(d, remat_lib.OFFLOADS[c.remat], t)
    offload = 2 * rows * d.length * d.layers * offloaded * d.act_bytes / HOST_BYTES_PER_S
  return max(compute, overlapped) + tensor + expert + offload
