"""Llama 4's vision tower: image tiles in, text-width soft tokens out, which replace the image placeholder
tokens' embeddings in order (Llama4ForConditionalGeneration; the processor lays out <|image_start|>,
<|patch|> placeholders, <|tile_x_separator|> ...; the model only fills the placeholders).

Per tile [S, S, C] (S = image_size_for_vit, P = patch_size_for_vit, G = S / P):
  patch embedding: each P x P patch flattened channel-major (c, i, j) times a [C*P*P, D] kernel, no bias;
  a learned class token appended last; learned position embeddings for the G*G + 1 tokens; a LayerNorm;
  encoder layers: pre-LayerNorm, bidirectional attention with biases and 2D rotary embeddings on
  interleaved pairs (the first half of each head's pairs rotate with the column, the second with the row,
  positions counted from 1; the class token is not rotated), then a gelu (erf) MLP with biases;
  a LayerNorm, the class token dropped;
  pixel shuffle by pixel_shuffle_ratio_for_vit r: the G x G grid becomes rG x rG with D / r^2 channels;
  the adapter MLP: gelu(gelu(x W1) W2), no biases (D / r^2 -> projector_input_dim -> projector_output_dim);
  the projector: a linear map, no bias, to emb_dim.
Each tile gives (r G)^2 soft tokens (144 for Scout and Maverick: S = 336, P = 14, r = 0.5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import LayerNorm
from MaxText.layers.vision import encoder_layers, run_layers


def tokens_per_image(config: ModelConfig) -> int:
  """Soft tokens one image tile becomes: the pixel-shuffled patch grid."""
  side = config.vision.image_size_for_vit // config.vision.patch_size_for_vit
  return round(side * config.vision.llama4.pixel_shuffle_ratio_for_vit) ** 2


def rope_angles(grid: int, head_dim: int, theta: float) -> np.ndarray:
  """Angles [grid*grid + 1, head_dim // 2] of the 2D rotary embedding, per token (patches row-major, then the
  class token, all zero) and per interleaved pair: pairs 0..head_dim/4-1 rotate with column + 1, the rest
  with row + 1, at frequencies theta^(-4k / head_dim)."""
  quarter = head_dim // 4
  freq = 1.0 / theta ** (np.arange(0, head_dim // 2, 2)[:quarter].astype(np.float32) / (head_dim // 2))
  index = np.arange(grid * grid)
  cols, rows = (index % grid + 1).astype(np.float32), (index // grid + 1).astype(np.float32)
  angles = np.concatenate([cols[:, None] * freq, rows[:, None] * freq], axis=-1)
  return np.concatenate([angles, np.zeros((1, head_dim // 2), np.float32)]).astype(np.float32)


def rotate_pairs(x: jax.Array, angles: jax.Array) -> jax.Array:
  """x [B, T, N, H] rotated pairwise: (x[2k], x[2k+1]) as the complex number x[2k] + i x[2k+1] times
  exp(i angles[t, k]); in float32, returned in x's dtype."""
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
  re, im = pairs[..., 0], pairs[..., 1]
  return jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x.shape).astype(x.dtype)


def pixel_shuffle(x: jax.Array, ratio: float) -> jax.Array:
  """[B, G*G, D] -> [B, (rG)^2, D / r^2], as Llama 4 folds neighbouring patches into channels."""
  b, n, d = x.shape
  g = round(n**0.5)
  x = x.reshape(b, g, round(g * ratio), round(d / ratio))
  x = jnp.swapaxes(x, 1, 2).reshape(b, round(g * ratio), round(g * ratio), round(d / ratio**2))
  return jnp.swapaxes(x, 1, 2).reshape(b, -1, round(d / ratio**2))


def _args(config: ModelConfig, rngs: nnx.Rngs) -> dict:
  return dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype), rngs=rngs)


def _norm(config: ModelConfig, dim: int) -> LayerNorm:
  dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
  return LayerNorm(dim, epsilon=config.vision.vision_layer_norm_epsilon, dtype=dt, weight_dtype=wdt)


class VisionLayer(nnx.Module):
  """One encoder layer: x + attention(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, n = config.vision.hidden_size_for_vit, config.vision.num_attention_heads_for_vit
    h, args = d // n, _args(config, rngs)
    self.input_layernorm = _norm(config, d)
    self.query = DenseGeneral(d, (n, h), ("embed", "heads", "kv"), use_bias=True, **args)
    self.key = DenseGeneral(d, (n, h), ("embed", "heads", "kv"), use_bias=True, **args)
    self.value = DenseGeneral(d, (n, h), ("embed", "heads", "kv"), use_bias=True, **args)
    self.out = DenseGeneral((n, h), d, ("heads", "kv", "embed"), use_bias=True, **args)
    self.post_attention_layernorm = _norm(config, d)
    self.fc1 = DenseGeneral(d, config.vision.intermediate_size_for_vit, ("embed", "mlp"), use_bias=True, **args)
    self.fc2 = DenseGeneral(config.vision.intermediate_size_for_vit, d, ("mlp", "embed"), use_bias=True, **args)

  def __call__(self, x: jax.Array, angles: jax.Array) -> jax.Array:
    h = self.input_layernorm(x)
    q, k, v = rotate_pairs(self.query(h), angles), rotate_pairs(self.key(h), angles), self.value(h)
    scale = jnp.asarray(q.shape[-1] ** -0.5, jnp.float32)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    x = x + self.out(jnp.einsum("BNTS,BSNH->BTNH", probs, v))
    return x + self.fc2(jax.nn.gelu(self.fc1(self.post_attention_layernorm(x)), approximate=False))


class Llama4VisionEncoder(nnx.Module):
  """Image tiles [B, N, S, S, C] (float, normalised as the processor does) -> soft tokens
  [B, N * tokens_per_image, emb_dim]. Weights on the text layers' logical axes (layers/vision.py); the encoder
  layers stacked and scanned under config.scan_layers, each rematerialised by `remat_policy`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, remat_policy: str = "none"):
    self.config, self.remat_policy, v = config, remat_policy, config.vision
    d, p, c = v.hidden_size_for_vit, v.patch_size_for_vit, v.num_channels_for_vit
    grid = v.image_size_for_vit // p
    args = _args(config, rngs)
    wdt = jnp.dtype(config.weight_dtype)
    self.patch_embedding = DenseGeneral(c * p * p, d, (None, "embed"), **args)
    init = nnx.initializers.normal(d**-0.5)
    self.class_embedding = nnx.Param(init(rngs.params(), (d,), wdt), out_sharding=("embed",))
    self.positional_embedding = nnx.Param(init(rngs.params(), (grid * grid + 1, d), wdt), out_sharding=(None, "embed"))
    self.layernorm_pre = _norm(config, d)
    self.num_layers = v.num_hidden_layers_for_vit
    self.layers = encoder_layers(functools.partial(VisionLayer, config), self.num_layers, config.scan_layers, rngs)
    self.layernorm_post = _norm(config, d)
    shuffled = round(d / v.llama4.pixel_shuffle_ratio_for_vit**2)
    # The adapter widens into `mlp` and comes back to the tower's `embed`; the projector maps that (as `mlp`:
    # its output is the text model's `embed`) to emb_dim.
    hidden, out_dim = v.llama4.projector_input_dim_for_vit, v.llama4.projector_output_dim_for_vit
    self.adapter_fc1 = DenseGeneral(shuffled, hidden, ("embed", "mlp"), **args)
    self.adapter_fc2 = DenseGeneral(hidden, out_dim, ("mlp", "embed"), **args)
    self.projector = DenseGeneral(out_dim, config.emb_dim, ("mlp", "embed"), **args)

  def flops_per_image(self) -> float:
    """Forward FLOPs of one image tile: 2 per multiply-add of every weight matmul over the tokens it sees
    (G*G patches; G*G + 1 tokens in the encoder; (rG)^2 after the pixel shuffle) plus the encoder's
    bidirectional QK^T and AV (2 * 2 * (G*G + 1)^2 * D per layer). Norms, gelu, softmax, rope not counted."""
    v = self.config.vision
    grid = v.image_size_for_vit // v.patch_size_for_vit
    tokens, shuffled = grid * grid + 1, tokens_per_image(self.config)

    def size(dense: DenseGeneral) -> int:
      return int(np.prod(dense.in_features + dense.out_features))

    layer = self.layers[0] if isinstance(self.layers, nnx.List) else self.layers  # sizes are per layer
    per_layer = sum(size(m) for m in (layer.query, layer.key, layer.value, layer.out, layer.fc1, layer.fc2))
    head = sum(size(m) for m in (self.adapter_fc1, self.adapter_fc2, self.projector))
    matmul = 2.0 * (grid * grid * size(self.patch_embedding) + tokens * per_layer * self.num_layers + shuffled * head)
    return matmul + 4.0 * tokens * tokens * v.hidden_size_for_vit * self.num_layers

  def __call__(self, images: jax.Array) -> jax.Array:
    v = self.config.vision
    b, n, s, _, ch = images.shape
    p, g = v.patch_size_for_vit, s // v.patch_size_for_vit
    dt = jnp.dtype(self.config.dtype)
    # Patches row-major, each flattened (channel, row, column) as torch's Unfold does.
    x = images.reshape(b * n, g, p, g, p, ch).transpose(0, 1, 3, 5, 2, 4).reshape(b * n, g * g, ch * p * p)
    x = self.patch_embedding(x)
    cls = jnp.broadcast_to(self.class_embedding[...].astype(dt), (b * n, 1, x.shape[-1]))
    x = jnp.concatenate([x, cls], axis=1) + self.positional_embedding[...].astype(dt)
    x = self.layernorm_pre(x)
    angles = jnp.asarray(rope_angles(g, x.shape[-1] // v.num_attention_heads_for_vit, v.llama4.rope_theta_for_vit))
    x = self.layernorm_post(run_layers(self.layers, x, self.remat_policy, angles))[:, :-1]
    x = pixel_shuffle(x, v.llama4.pixel_shuffle_ratio_for_vit)
    x = jax.nn.gelu(self.adapter_fc2(jax.nn.gelu(self.adapter_fc1(x), approximate=False)), approximate=False)
    x = self.projector(x)
    return x.reshape(b, n * x.shape[1], x.shape[-1])


def splice(x: jax.Array, tokens: jax.Array, soft: jax.Array, image_token_id: int) -> jax.Array:
  """Embeddings x [B, T, D] with row b's image_token_id placeholders replaced, in order, by soft [B, M, D]
  (placeholders past M keep their embedding; the data pipeline checks the counts)."""
  mask = tokens == image_token_id
  index = jnp.clip(jnp.cumsum(mask, axis=1) - 1, 0, soft.shape[1] - 1)
  gathered = jnp.take_along_axis(soft, index[..., None], axis=1).astype(x.dtype)
  return jnp.where(mask[..., None], gathered, x)
