"""attention=flash: JAX's Pallas splash-attention kernels (TPU), same contract as dot_product_attention.

The kernel works on one batch row of [heads, length, head_dim] arrays with static (causal, local) masks
and per-token segment ids, so it is vmapped over the batch. Inside an SPMD program a Pallas kernel
cannot be partitioned by XLA: given the run plan it runs per shard (parallel.ops.flash), with the batch
and the heads split over the mesh axes the plan resolved for them.

On CPU the kernels run in Pallas' interpreter (`interpret=True`): slow, for tests only.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from MaxText.parallel import ops
from MaxText.parallel.kernels import LANES

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

# Largest block first: bigger tiles amortise the per-block overhead; 512 is MaxText's default.
BLOCK_CHOICES = (512, 256, 128)


def block_size(length: int) -> int:
  """The largest of BLOCK_CHOICES dividing `length`; ValueError when length is not a multiple of 128."""
  for block in BLOCK_CHOICES:
    if length % block == 0:
      return block
  raise ValueError(
    f"attention=flash needs the sequence length to be a multiple of {LANES}; got {length}. "
    f"Set max_target_length to a multiple of {LANES} (e.g. {math.ceil(length / LANES) * LANES}) "
    "or use attention=dot_product"
  )


def _splash_mask(heads: int, length: int, sliding_window: int, chunk_window: int = 0) -> splash_mask.MultiHeadMask:
  """Causal, and local when 0 < sliding_window < length: query i sees keys j with i - window < j <= i;
  chunked when 0 < chunk_window < length: the same block of chunk_window places (i // C == j // C)."""
  if sliding_window and chunk_window:
    raise ValueError("flash_attention takes a sliding window or a chunk window, not both")
  if 0 < chunk_window < length:
    one = splash_mask.ChunkedCausalMask((length, length), chunk_size=chunk_window)
  elif 0 < sliding_window < length:
    one = splash_mask.LocalMask((length, length), window_size=(sliding_window - 1, 0), offset=0)
  else:
    one = splash_mask.CausalMask((length, length))
  return splash_mask.MultiHeadMask([one] * heads)


def _splash(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  sliding_window: int,
  logits_soft_cap: float,
  interpret: bool,
  chunk_window: int = 0,
) -> jax.Array:
  """The kernel on local (unsharded) arrays: q [B, T, N, H], k/v [B, T, K, H] -> [B, T, N, H]."""
  t, n = q.shape[1], q.shape[2]
  b = block_size(t)
  sizes = splash.BlockSizes(
    block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
    block_q_dq=b, block_kv_dq=b,
  )  # fmt: skip
  kernel = splash.make_splash_mha(
    _splash_mask(n, t, sliding_window, chunk_window),
    block_sizes=sizes,
    attn_logits_soft_cap=logits_soft_cap or None,
    head_shards=1,  # built per shard, on the local heads and the whole sequence
    q_seq_shards=1,
    interpret=interpret,
  )
  heads_major = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, T, N, H] <-> [B, N, T, H]
  ids = splash.SegmentIds(q=segment_ids, kv=segment_ids)
  out = jax.vmap(kernel)(heads_major(q), heads_major(k), heads_major(v), ids)
  return heads_major(out)


def flash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  sliding_window: int = 0,
  logits_soft_cap: float = 0.0,
  interpret: bool = False,
  chunk_window: int = 0,
  plan: Plan | None = None,
) -> jax.Array:
  """Causal, packing-aware GQA attention through the splash kernels; dot_product_attention's contract.

  q [B, T, N, H] already scaled by the query scale, k/v [B, T, K, H] with N a multiple of K, segment_ids
  [B, T] int (tokens attend within their own segment id) -> [B, T, N, H] in q's dtype. sliding_window > 0:
  query i sees keys j with i - window < j <= i; chunk_window > 0: the same block of chunk_window places.
  logits_soft_cap > 0: logits -> cap * tanh(logits / cap).
  T must be a multiple of 128 (ValueError otherwise). interpret=True runs the Pallas interpreter (CPU).
  With a `plan` the kernel runs per shard of the plan's mesh (parallel.ops.flash); without one, directly.
  """
  if k.shape != v.shape or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
    raise ValueError(
      f"flash_attention needs q [B, T, N, H] and k, v [B, T, K, H] with N a multiple of K; got "
      f"q {q.shape}, k {k.shape}, v {v.shape}"
    )
  if segment_ids.shape != q.shape[:2]:
    raise ValueError(f"segment_ids must be [B, T] = {q.shape[:2]}; got {segment_ids.shape}")
  block_size(q.shape[1])  # fail with the length the user set, not a per-shard one
  body = functools.partial(
    _splash, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, interpret=interpret,
    chunk_window=chunk_window,
  )  # fmt: skip
  return body(q, k, v, segment_ids) if plan is None else ops.flash(plan, body, q, k, v, segment_ids)
