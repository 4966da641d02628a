"""The decoder stack: embedding, layers (scanned or unrolled, rematerialised), final norm, logits.

A family (models/<family>.py) describes itself as data, a `Family`: which layers in which stacks,
its norm convention, whether embeddings are scaled. Everything around the layers is shared. Layers
are applied as pure functions of their parameters (nnx.split / nnx.merge) so that jax.lax.scan and
jax.checkpoint see plain pytrees. Families that alternate layer kinds (local/global attention) scan
over a repeating `LayerBlock`; families whose first layers differ (dense, then MoE) use two stacks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from MaxText.layers import context_parallel, pipeline, vision
from MaxText.layers import lora as lora_lib
from MaxText.layers import mtp as mtp_lib
from MaxText.layers.attention import ImageSegments, soft_cap
from MaxText.layers.axes import ACTIVATION_AXES, LOGITS_AXES
from MaxText.layers.decoder_layer import DecoderLayer, dropout
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.model_config import ModelConfig
from MaxText.layers.moe import ExpertLoad
from MaxText.layers.normalizations import RMSNorm
from MaxText.parallel.remat import remat

if TYPE_CHECKING:
  from MaxText.parallel.plan import Plan

__all__ = [
  "ACTIVATION_AXES",
  "Decoder",
  "DecoderOutput",
  "Family",
  "LayerBlock",
  "Stack",
  "alternating_stacks",
  "dropout",
]


@dataclasses.dataclass(frozen=True)
class Stack:
  """`repeats` copies of the unit `make(config, rngs=..., plan=...)`, each unit holding `layers_per_unit` layers."""

  name: str  # the Decoder attribute holding the stack (its parameter path)
  make: Callable[..., nnx.Module]
  repeats: int
  layers_per_unit: int = 1


def single_stack(config: ModelConfig) -> tuple[Stack, ...]:
  return (Stack("layers", DecoderLayer, config.num_decoder_layers),)


@dataclasses.dataclass(frozen=True)
class Family:
  """What a model family changes around its layers."""

  stacks: Callable[[ModelConfig], tuple[Stack, ...]] = single_stack  # the layers, in order
  norm: Callable[..., nnx.Module] = RMSNorm  # the final norm's convention
  scale_embeddings: bool = False  # multiply token embeddings by sqrt(emb_dim) (gemma)
  learned_positions: bool = False  # add a trainable_position_size x emb_dim position embedding (gpt3)
  mtp_layer: Callable[..., nnx.Module] | None = None  # the layer of each MTP module (None: no mtp_num_layers)
  # use_multimodal: make(config, rngs=...) -> a module mapping images [B, N, H, W, C] to soft tokens [B, M, D]
  # whose call replaces the image_token_id embeddings; `splice(x, tokens, soft, image_token_id)` places them
  vision: Callable[..., nnx.Module] | None = None
  splice: Callable[..., jax.Array] | None = None
  # make(config, rngs=...) -> a module mapping (tokens [B, T], embeddings [B, T, D]) to an input per layer
  # [L, B, T, P], which the decoder passes to each unit's call as `layer_inputs` ([layers_per_unit, B, T, P])
  layer_inputs: Callable[..., nnx.Module] | None = None


class LayerBlock(nnx.Module):
  """A repeating unit of differently configured layers, applied in order (e.g. local, global)."""

  def __init__(self, config: ModelConfig, makers: tuple[Callable[..., nnx.Module], ...], *, rngs: nnx.Rngs, plan: Plan):
    self.sublayers = nnx.List([make(config, rngs=rngs, plan=plan) for make in makers])

  def __call__(
    self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rng: jax.Array | None, cache: Any = None,
    **layer_inputs: jax.Array,
  ) -> tuple[jax.Array, Any]:  # fmt: skip
    """The DecoderLayer contract; a decode `cache` is a tuple, one per sublayer (None in training);
    `layer_inputs` (Family.layer_inputs) [n, B, T, P]: sublayer i gets [i]."""
    new_cache = []
    for i, layer in enumerate(self.sublayers):
      layer_rng = None if rng is None else jax.random.fold_in(rng, i)
      extra = {k: v[i] for k, v in layer_inputs.items()}
      x, layer_cache = layer(x, positions, segment_ids, layer_rng, None if cache is None else cache[i], **extra)
      new_cache.append(layer_cache)
    return x, None if cache is None else tuple(new_cache)

  def init_cache(self, batch: int, length: int) -> tuple:
    return tuple(layer.init_cache(batch, length) for layer in self.sublayers)


def alternating_stacks(config: ModelConfig, pattern: tuple[Callable[..., nnx.Module], ...]) -> tuple[Stack, ...]:
  """Layers cycling through the builders `pattern` (layer i is pattern[i % len]): whole cycles are scanned
  as one LayerBlock; a shorter remainder cycle, if any, forms a second stack (gemma2, gemma3)."""
  period = len(pattern)
  cycles, rest = divmod(config.num_decoder_layers, period)
  out = []
  if cycles:
    out.append(Stack("layers", functools.partial(LayerBlock, makers=pattern), cycles, period))
  if rest:
    out.append(Stack("remainder_layers", functools.partial(LayerBlock, makers=pattern[:rest]), 1, rest))
  return tuple(out)


def _stacked_layers(stack: Stack, config: ModelConfig, rngs: nnx.Rngs, plan: Plan) -> nnx.Module:
  """One module whose parameters carry a leading `layers` axis of size stack.repeats."""

  @nnx.split_rngs(splits=stack.repeats)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def create(rngs: nnx.Rngs) -> nnx.Module:
    return stack.make(config, rngs=rngs, plan=plan)

  return create(rngs)


def _unrolled_layers(stack: Stack, config: ModelConfig, rngs: nnx.Rngs, plan: Plan) -> nnx.List:
  """stack.repeats separate modules, initialised exactly like the stacked ones.

  Slicing the stacked initialisation makes scan_layers=true and false the same model for a seed
  (and costs nothing under jit, where the stacked arrays are never materialised whole).
  """
  _, stacked = nnx.split(_stacked_layers(stack, config, rngs, plan))
  graphdef, template = nnx.split(nnx.eval_shape(lambda: stack.make(config, rngs=nnx.Rngs(0), plan=plan)))
  treedef = jax.tree.structure(template)
  leaves = jax.tree.leaves(stacked)
  return nnx.List(
    [nnx.merge(graphdef, jax.tree.unflatten(treedef, [x[i] for x in leaves])) for i in range(stack.repeats)]
  )


def _intermediates_sum(module: nnx.Module) -> jax.Array:
  """Sum of the values a layer recorded as nnx.Intermediate during its call (MoE auxiliary losses; not the
  expert loads, which are counts)."""
  values = jax.tree.leaves(nnx.state(module, nnx.All(nnx.Intermediate, nnx.Not(ExpertLoad))))
  return sum((jnp.sum(v).astype(jnp.float32) for v in values), jnp.zeros((), jnp.float32))


def _expert_loads(module: nnx.Module) -> dict[str, Any]:
  """The moe.ExpertLoad counts a layer recorded during its call, as a plain dict keyed like its parameters
  ({"mlp": {"expert_load": int32 [E]}}; {} for a dense layer)."""
  return nnx.state(module, ExpertLoad).to_pure_dict()


class DecoderOutput(NamedTuple):
  logits: jax.Array  # [B, T, V]; with forward(..., hidden_only=True) the final hidden states [B, T, D]
  aux_loss: jax.Array  # float32 scalar: the layers' auxiliary losses (MoE load balance), averaged over layers
  cache: Any = None  # decoding: the updated caches, {stack name: per-layer caches}
  mtp: tuple[jax.Array, ...] = ()  # forward(..., mtp=True): per MTP depth, its normed hidden states [B, T, D]
  # Per MoE layer with a selection bias, its expert loads (int32 [E], [n, E] for a stack of n scanned units),
  # at the path of its parameters but with `expert_load` in place of `gate_bias`; {} without such layers.
  expert_load: Any = None


class Decoder(nnx.Module):
  """tokens [B, T] -> logits [B, T, V]. `plan`: the run plan (parallel/plan.py), which says how the layers
  run (attention kernel, context split, pipeline, MoE dispatch, remat, dropout); the configuration it was
  built from has been checked there. `lora`: the adapters to add (None: none); `freeze_vision_encoder`: no
  gradient flows into the vision tower and projector (training; the optimizer also keeps them)."""

  def __init__(
    self,
    config: ModelConfig,
    family: Family,
    *,
    rngs: nnx.Rngs,
    plan: Plan,
    lora: lora_lib.LoraConfig | None = None,
    freeze_vision_encoder: bool = True,
  ):
    dt, wdt = jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)
    self.config, self.family, self.plan = config, family, plan
    self.freeze_vision_encoder = freeze_vision_encoder
    embed = dict(dtype=dt, weight_dtype=wdt, rngs=rngs, iota=config.embed.use_iota_embed)
    self.token_embedder = Embed(config.vocab_size, config.emb_dim, **embed)
    self.position_embedder = nnx.data(None)
    if family.learned_positions:
      self.position_embedder = Embed(config.embed.trainable_position_size, config.emb_dim, **embed)
    self.stack_specs = lora_lib.adapted_stacks(family.stacks(config), lora)  # LoRA adapters, when lora_rank > 0
    build = _stacked_layers if config.scan_layers else _unrolled_layers
    for stack in self.stack_specs:
      setattr(self, stack.name, build(stack, config, rngs, plan))
    self.decoder_norm = family.norm(
      config.emb_dim, epsilon=config.norms.normalization_layer_epsilon, dtype=dt, weight_dtype=wdt
    )
    self.logits_dense = nnx.data(None)
    if not config.embed.logits_via_embedding:
      self.logits_dense = DenseGeneral(
        config.emb_dim, config.vocab_size, ("embed", "vocab"), dtype=dt, weight_dtype=wdt, rngs=rngs
      )
    # Last: the main model's parameters stay those of mtp_num_layers=0 for a seed.
    self.mtp_modules = nnx.data(None)
    if config.mtp_num_layers:
      layer = functools.partial(family.mtp_layer, plan=plan)
      self.mtp_modules = nnx.List([mtp_lib.MtpModule(config, layer, rngs=rngs) for _ in range(config.mtp_num_layers)])
    # After the text model too: use_multimodal adds the image encoder without changing the text parameters
    # (the family's own tower, e.g. Llama 4's, else Gemma 3's SigLIP).
    self.per_layer_inputs = nnx.data(None)
    if family.layer_inputs is not None:
      self.per_layer_inputs = family.layer_inputs(config, rngs=rngs)
    self.vision_encoder = nnx.data(None)
    if config.vision is not None:
      tower = (family.vision or vision.VisionEncoder)(config, rngs=rngs, remat_policy=plan.remat_policy)
      self.vision_encoder = lora_lib.adapted_tower(tower, lora, rngs)  # LoRA adapters, when the tower trains

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    dropout_rng: jax.Array | None = None,
    images: jax.Array | None = None,
  ) -> jax.Array:
    return self.forward(tokens, positions, segment_ids, dropout_rng, images=images).logits

  def forward(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    dropout_rng: jax.Array | None = None,
    cache: dict[str, Any] | None = None,
    hidden_only: bool = False,
    mtp: bool = False,
    images: jax.Array | None = None,
  ) -> DecoderOutput:
    """tokens/positions/segment_ids [B, T] -> logits [B, T, V] and the auxiliary loss.

    Decoding: `cache` from init_cache; each token's keys/values are written at its position and
    queries attend over the cache (layers/kv_cache.py); the output carries the updated cache.
    hidden_only: return the final-norm hidden states [B, T, D] in place of logits, for a caller that
    applies `logits` itself piece by piece (the vocab-tiled loss).
    mtp: also run the multi-token-prediction modules (training; the model must have them) and return
    their hidden states for `logits` in `.mtp`; their MoE losses join aux_loss, averaged over all layers.
    images: float pixels [B, N, H, W, C] in [-1, 1] (use_multimodal): their soft tokens replace the
    image_token_id placeholders in order, and each image's tokens attend to each other both ways.
    """
    c = self.config
    # MTP depth k reads token i + k at position i: shifted here, in the natural order of the sequence.
    ahead = [mtp_lib.shift_left(tokens, k) for k in range(1, c.mtp_num_layers + 1)] if mtp else []
    # Context parallelism with load balancing: the layers run on the balanced layout, undone at the end (the
    # plan refuses it with images).
    run = self.plan.attention
    shards = run.context_shards if cache is None and run.load_balanced else 1
    if shards > 1:
      tokens, positions, segment_ids = (context_parallel.balance(a, shards) for a in (tokens, positions, segment_ids))
      ahead = [context_parallel.balance(a, shards) for a in ahead]
    x, segment_ids = self._embed(tokens, positions, segment_ids, images)
    if not self.plan.dropout_rate > 0:
      dropout_rng = None
    aux, first, new_cache, loads = jnp.zeros((), jnp.float32), 0, {}, {}
    per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(tokens, x)  # [L, B, T, P]
    layer = 0
    for stack in self.stack_specs:
      stack_cache = None if cache is None else cache[stack.name]
      inputs = None
      if per_layer is not None:  # [repeats, layers_per_unit, B, T, P]
        n = stack.repeats * stack.layers_per_unit
        inputs = per_layer[layer : layer + n].reshape(stack.repeats, stack.layers_per_unit, *per_layer.shape[1:])
        layer += n
      x, stack_aux, new_cache[stack.name], stack_loads = self._apply_stack(
        stack, x, positions, segment_ids, dropout_rng, first, stack_cache, inputs
      )
      aux, first = aux + stack_aux, first + stack.repeats
      if stack_loads:
        loads[stack.name] = stack_loads
    mtp_hidden, mtp_aux, mtp_loads = self._apply_mtp(x, ahead, positions, segment_ids, dropout_rng, first)
    if mtp_loads:
      loads["mtp_modules"] = mtp_loads
    x = self.decoder_norm(x)
    out = x if hidden_only else self.logits(x)
    if shards > 1:
      out = context_parallel.unbalance(out, shards)
      mtp_hidden = tuple(context_parallel.unbalance(m, shards) for m in mtp_hidden)
    aux = (aux + mtp_aux) / (c.num_decoder_layers + len(mtp_hidden))
    return DecoderOutput(out, aux, None if cache is None else new_cache, mtp_hidden, loads)

  def _embed(self, tokens, positions, segment_ids, images):
    """Token (and learned position) embeddings [B, T, D], with the images' soft tokens in place of their
    placeholders; returns them and the segment ids the layers take (ImageSegments for Gemma 3's image blocks)."""
    c = self.config
    x = self.token_embedder(jnp.where(tokens < c.vocab_size, tokens, 0))  # placeholders may lie past the vocab
    if self.position_embedder is not None:
      x = x + self.position_embedder(positions)
    if self.family.scale_embeddings:
      x = x * jnp.asarray(c.emb_dim**0.5, x.dtype)
    if images is not None:
      if self.vision_encoder is None:
        raise ValueError("images given to a text-only model (use_multimodal=false)")
      soft = self.vision_encoder(images)
      if self.freeze_vision_encoder:  # the tower and projector get no gradient (the optimizer also keeps them)
        soft = jax.lax.stop_gradient(soft)
      if self.family.splice is not None:  # the family's own placement (Llama 4: causal over the image tokens)
        x = self.family.splice(x, tokens, soft, c.vision.image_token_id)
      else:  # Gemma 3: each image's tokens attend to each other both ways
        x = vision.splice(x, tokens, soft, c.vision.image_token_id)
        segment_ids = ImageSegments(segment_ids, vision.image_blocks(tokens, c.vision.image_token_id))
    return nn.with_logical_constraint(x, ACTIVATION_AXES), segment_ids

  def _apply_mtp(self, h, ahead, positions, segment_ids, dropout_rng, first_index):
    """The MTP depths in turn: h^0 (the last layer's output, before the final norm) [B, T, D] and per depth
    k the tokens t_{i+k} [B, T] -> (per depth its normed hidden states [B, T, D], their layers' summed aux
    loss, their expert loads {k: {"layer": ...}}). Each layer runs like the decoder's own (remat policy;
    dropout key from its index after the last)."""
    normed, aux, loads = [], jnp.zeros((), jnp.float32), {}
    for k, (module, tokens_ahead) in enumerate(zip(self.mtp_modules or [], ahead)):
      x = nn.with_logical_constraint(module.mix(h, self.token_embedder(tokens_ahead)), ACTIVATION_AXES)
      graphdef, params = nnx.split(module.layer)
      # _run_units takes stacked units under scan_layers (a stack of one here), else a list.
      params = jax.tree.map(lambda p: p[None], params) if self.config.scan_layers else [params]
      h, layer_aux, _, layer_loads = self._run_units(
        graphdef, params, x, positions, segment_ids, dropout_rng, first_index + k
      )
      normed.append(module.shared_head_norm(h))
      aux = aux + layer_aux
      # The one unit's loads: unstacked (scan) or taken from the list.
      layer_loads = jax.tree.map(lambda a: a[0], layer_loads) if self.config.scan_layers else layer_loads.get(0)
      if layer_loads:
        loads[k] = {"layer": layer_loads}
    return tuple(normed), aux, loads

  def logits(self, x: jax.Array) -> jax.Array:
    """Final hidden states [B, T, D] -> logits [B, T, V] (tied or not, soft-capped)."""
    c = self.config
    logits_dtype = jnp.float32 if c.embed.logits_dot_in_fp32 else jnp.dtype(c.dtype)
    if self.logits_dense is None:
      logits = self.token_embedder.attend(x, logits_dtype)
    else:
      logits = self.logits_dense(x.astype(logits_dtype)) if c.embed.logits_dot_in_fp32 else self.logits_dense(x)
    logits = soft_cap(logits, c.embed.final_logits_soft_cap)
    return nn.with_logical_constraint(logits, LOGITS_AXES)

  def init_cache(self, batch: int, length: int) -> dict[str, Any]:
    """Empty decode caches of `length` slots: per stack, a leading layers axis (scan) or a list."""
    caches = {}
    for stack in self.stack_specs:
      layers = getattr(self, stack.name)
      if self.config.scan_layers:  # the stacked module's methods see one unit's config
        unit = layers.init_cache(batch, length)
        caches[stack.name] = jax.tree.map(lambda a, n=stack.repeats: jnp.zeros((n, *a.shape), a.dtype), unit)
      else:
        caches[stack.name] = [layer.init_cache(batch, length) for layer in layers]
    return caches

  def _apply_stack(self, stack, x, positions, segment_ids, dropout_rng, first_index, cache=None, inputs=None):
    c = self.config
    layers = getattr(self, stack.name)
    if c.scan_layers:
      graphdef, params = nnx.split(layers)
    else:
      graphdef, _ = nnx.split(layers[0])
      params = [nnx.split(layer)[1] for layer in layers]
    pipe = self.plan.pipeline
    piped = pipe.units_of(stack.name) if pipe is not None and cache is None else 0
    if not piped:
      return self._run_units(graphdef, params, x, positions, segment_ids, dropout_rng, first_index, cache, inputs)

    def stage(stage_params, h, stage_positions, stage_segments, index, micro):
      # Each microbatch draws its own dropout masks (a slice of the whole batch's would need them all).
      # Expert loads are not returned through the pipeline (routed_bias_update_rate is refused with it).
      rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, micro)
      h, aux, _, _ = self._run_units(graphdef, stage_params, h, stage_positions, stage_segments, rng, index)
      return h, aux

    head = jax.tree.map(lambda p: p[:piped], params)
    x, aux = pipeline.run(stage, head, x, positions, segment_ids, pipe.schedule, first_index, self.plan.axes.stage)
    if piped < stack.repeats:  # pipeline_parallel_layers left these units out: they run after, unpipelined
      tail = jax.tree.map(lambda p: p[piped:], params)
      x, tail_aux, _, _ = self._run_units(graphdef, tail, x, positions, segment_ids, dropout_rng, first_index + piped)
      aux = aux + tail_aux
    return x, aux, None, {}

  def _run_units(self, graphdef, params, x, positions, segment_ids, dropout_rng, first_index, cache=None, inputs=None):
    """Units (stacked params [n, ...] under scan_layers, else a list) applied in order to x [B, T, D];
    returns (x, the units' summed auxiliary loss, the updated caches or None, their expert loads: stacked
    [n, E] leaves under scan, else {unit index: loads}; {} without MoE selection biases). `first_index`: the
    first unit's index in the model, which seeds its dropout key. `inputs`: the units' layer inputs [n, ...]
    (Family.layer_inputs), passed to each unit's call as `layer_inputs`."""
    c = self.config

    def one_unit(carry, xs):
      (h, aux, index), (unit_params, unit_cache, unit_inputs) = carry, xs
      rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
      unit = nnx.merge(graphdef, unit_params)
      extra = {} if unit_inputs is None else {"layer_inputs": unit_inputs}
      h, unit_cache = unit(h, positions, segment_ids, rng, unit_cache, **extra)
      h = nn.with_logical_constraint(h, ACTIVATION_AXES)
      return (h, aux + _intermediates_sum(unit), index + 1), (unit_cache, _expert_loads(unit))

    # Under scan, CSE across iterations cannot happen, so prevent_cse (which costs fusion) is off.
    body = remat(one_unit, self.plan.remat_policy, prevent_cse=not c.scan_layers)
    carry = (x, jnp.zeros((), jnp.float32), jnp.asarray(first_index, jnp.int32))
    if c.scan_layers:
      carry, (cache, loads) = jax.lax.scan(body, carry, (params, cache, inputs))
    else:
      caches, loads = [None] * len(params) if cache is None else list(cache), {}
      for i, unit_params in enumerate(params):
        unit_inputs = None if inputs is None else inputs[i]
        carry, (caches[i], unit_loads) = body(carry, (unit_params, caches[i], unit_inputs))
        if unit_loads:
          loads[i] = unit_loads
      cache = None if cache is None else caches
    return carry[0], carry[1], cache, loads
