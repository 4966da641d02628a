"""Next-token sampling from logits [B, V], inside the jitted decode step.

Strategies (decode_sampling_strategy): greedy (argmax); weighted (softmax of logits / temperature);
topk (weighted among the top_k most likely); nucleus (weighted among the smallest set of most likely
tokens whose probability reaches nucleus_p); composite (top-k, then nucleus, then weighted). Logits are
divided by the temperature first; temperature 0 is greedy. Temperature, top_k and nucleus_p are traced
values, so changing them does not recompile; the strategy is static.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

STRATEGIES = ("greedy", "weighted", "nucleus", "topk", "composite")
NEG_INF = -jnp.inf


class SamplingParams(NamedTuple):
  temperature: jax.Array | float = 1.0  # 0: greedy
  top_k: jax.Array | int = 40  # topk and composite: keep this many most likely tokens
  nucleus_p: jax.Array | float = 0.9  # nucleus and composite: keep this much probability mass


def top_k_filter(logits: jax.Array, k: jax.Array | int) -> jax.Array:
  """logits [B, V] with all but the k largest per row set to -inf (ties at the k-th value kept)."""
  b, v = logits.shape
  index = jnp.broadcast_to(jnp.clip(v - jnp.asarray(k, jnp.int32), 0, v - 1), (b, 1))
  kth = jnp.take_along_axis(jnp.sort(logits, axis=-1), index, axis=-1)  # the k-th largest per row
  return jnp.where(logits >= kth, logits, NEG_INF)


def nucleus_filter(logits: jax.Array, p: jax.Array | float) -> jax.Array:
  """logits [B, V] keeping only the smallest set of most likely tokens whose probability is >= p."""
  probs = jax.nn.softmax(logits, axis=-1)
  sorted_probs = jnp.sort(probs, axis=-1)[:, ::-1]
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of strictly more likely tokens
  keep = mass_before < p  # the most likely token is always kept
  threshold = jnp.min(jnp.where(keep, sorted_probs, 1.0), axis=-1, keepdims=True)
  return jnp.where(probs >= threshold, logits, NEG_INF)


def sample(logits: jax.Array, rng: jax.Array, strategy: str, params: SamplingParams) -> jax.Array:
  """logits [B, V] -> token ids [B] int32."""
  if strategy not in STRATEGIES:
    raise ValueError(f"decode_sampling_strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if strategy == "greedy":
    return greedy
  temperature = jnp.asarray(params.temperature, jnp.float32)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  if strategy in ("topk", "composite"):
    scaled = top_k_filter(scaled, params.top_k)
  if strategy in ("nucleus", "composite"):
    scaled = nucleus_filter(scaled, params.nucleus_p)
  sampled = jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy)


def log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Log-probability [B] of `tokens` [B] under the model's own distribution softmax(logits [B, V])."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
