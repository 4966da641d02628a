"""Images in: a SigLIP vision tower, Gemma 3's projector to the text width, and the splice of the image soft
tokens into the token embeddings at the image placeholders (shared by every vision-language family).

Images arrive as float pixels [B, N, H, W, C] already scaled to [-1, 1] (data/images.py); each image gives
`mm_tokens_per_image` soft tokens, which replace, in order, the `image_token_id` placeholders of its row.
Attention over the tokens of one image is bidirectional (attention.ImageSegments carries the blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.normalizations import LayerNorm, gemma_rms_norm
from MaxText.parallel.remat import remat

# The towers' weights name the text layers' logical axes (the tower's width is `embed`, its heads `heads`, its
# MLP `mlp`), so base.yml's rules shard them over fsdp / tensor like the decoder's; the encoder layers are
# stacked on a leading `layers` axis under scan_layers. The projector's input is `mlp` and its output `embed`
# (one mesh axis cannot shard both dims of one kernel).
TOWER_AXES = ("activation_batch", None, "activation_embed")  # [M images, T patches, D] hidden states


def _args(config: ModelConfig, rngs: nnx.Rngs) -> dict:
  return dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype), rngs=rngs)


def encoder_layers(make: Callable[..., nnx.Module], n: int, scan: bool, rngs: nnx.Rngs) -> nnx.Module:
  """`n` layers `make(rngs=...)`: one module whose parameters carry a leading `layers` axis (scan), else an nnx.List
  of `n` modules sliced from that same stacked initialisation, so that both layouts are one model for a seed."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return make(rngs=rngs)

  stacked = create(rngs)
  if scan:
    return stacked
  graphdef, template = nnx.split(nnx.eval_shape(lambda: make(rngs=nnx.Rngs(0))))
  treedef, leaves = jax.tree.structure(template), jax.tree.leaves(nnx.split(stacked)[1])
  return nnx.List([nnx.merge(graphdef, jax.tree.unflatten(treedef, [x[i] for x in leaves])) for i in range(n)])


def run_layers(layers: nnx.Module, x: jax.Array, policy: str, *args: jax.Array) -> jax.Array:
  """x [M, T, D] through encoder_layers' `layers` (each called as layer(x, *args)): one jax.lax.scan over a
  stacked module, else a Python loop; every layer rematerialised under the remat `policy`."""
  scan = not isinstance(layers, nnx.List)

  def step(graphdef: nnx.GraphDef) -> Callable:
    def body(h: jax.Array, params: nnx.State) -> tuple[jax.Array, None]:
      return nn.with_logical_constraint(nnx.merge(graphdef, params)(h, *args), TOWER_AXES), None

    return remat(body, policy, prevent_cse=not scan)  # CSE cannot cross scan iterations

  x = nn.with_logical_constraint(x, TOWER_AXES)
  if scan:
    graphdef, params = nnx.split(layers)
    return jax.lax.scan(step(graphdef), x, params)[0]
  for layer in layers:
    graphdef, params = nnx.split(layer)
    x = step(graphdef)(x, params)[0]
  return x


class SiglipLayer(nnx.Module):
  """Pre-LayerNorm encoder layer: full (unmasked) multi-head attention with biases, then a gelu(tanh) MLP."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, n = config.vision.hidden_size_for_vit, config.vision.num_attention_heads_for_vit
    h = d // n
    args = _args(config, rngs)
    norm = dict(epsilon=config.vision.vision_layer_norm_epsilon, dtype=args["dtype"], weight_dtype=args["weight_dtype"])
    self.layer_norm1 = LayerNorm(d, **norm)
    self.query = DenseGeneral(d, (n, h), ("embed", "heads", "kv"), use_bias=True, **args)
    self.key = DenseGeneral(d, (n, h), ("embed", "heads", "kv"), use_bias=True, **args)
    self.value = DenseGeneral(d, (n, h), ("embed", "heads", "kv"), use_bias=True, **args)
    self.out = DenseGeneral((n, h), d, ("heads", "kv", "embed"), use_bias=True, **args)
    self.layer_norm2 = LayerNorm(d, **norm)
    self.fc1 = DenseGeneral(d, config.vision.intermediate_size_for_vit, ("embed", "mlp"), use_bias=True, **args)
    self.fc2 = DenseGeneral(config.vision.intermediate_size_for_vit, d, ("mlp", "embed"), use_bias=True, **args)
    self.scale = h**-0.5

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.layer_norm1(x)
    q, k, v = self.query(h) * jnp.asarray(self.scale, h.dtype), self.key(h), self.value(h)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    x = x + self.out(jnp.einsum("BNTS,BSNH->BTNH", probs, v))
    h = jax.nn.gelu(self.fc1(self.layer_norm2(x)), approximate=True)
    return x + self.fc2(h)


class VisionEncoder(nnx.Module):
  """Gemma 3's image encoder: pixels [B, N, H, W, C] -> soft tokens [B, N * mm_tokens_per_image, emb_dim].

  SigLIP: a patch embedding (a stride-`patch` convolution, stored as a [C, P, P, D] kernel with a bias) plus
  learned position embeddings, the encoder layers, a final LayerNorm. The projector average-pools the patch
  grid to sqrt(mm_tokens_per_image) per side, applies a Gemma RMSNorm (1 + w) and projects to emb_dim.
  The encoder layers are stacked and scanned under config.scan_layers, each rematerialised by `remat_policy`.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, remat_policy: str = "none"):
    c, p, d = config.vision.num_channels_for_vit, config.vision.patch_size_for_vit, config.vision.hidden_size_for_vit
    args = _args(config, rngs)
    self.config, self.remat_policy = config, remat_policy
    self.patches_per_side = config.vision.image_size_for_vit // p
    self.tokens_per_side = int(round(config.vision.mm_tokens_per_image**0.5))
    self.patch_embedding = DenseGeneral((c, p, p), d, (None, None, None, "embed"), use_bias=True, **args)
    init = nnx.initializers.normal(0.02)
    self.position_embedding = nnx.Param(
      init(rngs.params(), (self.patches_per_side**2, d), args["weight_dtype"]), out_sharding=(None, "embed")
    )
    self.num_layers = config.vision.num_hidden_layers_for_vit
    self.layers = encoder_layers(functools.partial(SiglipLayer, config), self.num_layers, config.scan_layers, rngs)
    norm = dict(dtype=args["dtype"], weight_dtype=args["weight_dtype"])
    self.post_layernorm = LayerNorm(d, epsilon=config.vision.vision_layer_norm_epsilon, **norm)
    self.mm_soft_emb_norm = gemma_rms_norm(d, epsilon=config.vision.vision_layer_norm_epsilon, **norm)
    self.mm_input_projection = DenseGeneral(d, config.emb_dim, ("mlp", "embed"), **args)

  def encode(self, pixels: jax.Array) -> jax.Array:
    """pixels [M, H, W, C] -> SigLIP's last hidden states [M, patches, hidden_size_for_vit]."""
    m, height, width, c = pixels.shape
    p, g = self.config.vision.patch_size_for_vit, self.patches_per_side
    if height != width or height != g * p:
      raise ValueError(f"images must be {g * p}x{g * p} (image_size_for_vit), got {height}x{width}")
    patches = pixels.reshape(m, g, p, g, p, c).transpose(0, 1, 3, 5, 2, 4).reshape(m, g * g, c, p, p)
    x = self.patch_embedding(patches.astype(self.patch_embedding.dtype))
    x = x + self.position_embedding[...].astype(x.dtype)
    return self.post_layernorm(run_layers(self.layers, x, self.remat_policy))

  def project(self, hidden: jax.Array) -> jax.Array:
    """[M, patches, hidden] -> [M, mm_tokens_per_image, emb_dim]: average pooling over the patch grid, norm,
    projection."""
    m, _, d = hidden.shape
    g, t = self.patches_per_side, self.tokens_per_side
    k = g // t
    pooled = hidden.reshape(m, t, k, t, k, d).astype(jnp.float32).mean(axis=(2, 4)).astype(hidden.dtype)
    return self.mm_input_projection(self.mm_soft_emb_norm(pooled.reshape(m, t * t, d)))

  def __call__(self, images: jax.Array) -> jax.Array:
    b, n = images.shape[:2]
    soft = self.project(self.encode(images.reshape(b * n, *images.shape[2:])))
    return soft.reshape(b, n * soft.shape[1], soft.shape[2])


def image_blocks(tokens: jax.Array, image_token_id: int) -> jax.Array:
  """tokens [B, T] -> int32 [B, T]: for each run of consecutive image placeholders its index in the row (0, 1,
  ...), -1 on text. Tokens of one block attend to each other both ways."""
  is_image = tokens == image_token_id
  previous = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
  group = jnp.cumsum((is_image & ~previous).astype(jnp.int32), axis=1) - 1
  return jnp.where(is_image, group, -1)


def splice(x: jax.Array, tokens: jax.Array, soft: jax.Array, image_token_id: int) -> jax.Array:
  """Token embeddings x [B, T, D]: the k-th image placeholder of a row takes soft token k of the row's
  images, soft [B, N * mm_tokens_per_image, D]; placeholders beyond the soft tokens keep their embedding."""
  is_image = tokens == image_token_id
  index = jnp.cumsum(is_image.astype(jnp.int32), axis=1) - 1
  valid = is_image & (index < soft.shape[1])
  taken = jnp.take_along_axis(soft, jnp.clip(index, 0, soft.shape[1] - 1)[..., None], axis=1)
  return jnp.where(valid[..., None], taken.astype(x.dtype), x)
