"""Load a model once (config + checkpoint, or random weights), then generate() for batches of prompts.

Prompts of different lengths are right-padded to a bucket (a power of two, at most
max_prefill_predict_length) and prefilled in one pass that fills the KV cache; then one jitted step
per token feeds each row's last token at that row's own position (layers/kv_cache.py). Compiled
programs are cached per (prefill bucket, cache length, batch, strategy): no recompilation per token
or per prompt length. The batch is padded to a multiple of the mesh's batch shards.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from MaxText import checkpointing, config_checks, planner, sharding
from MaxText import state as state_lib
from MaxText.config import Config, serving_config
from MaxText.data import images as images_lib
from MaxText.errors import ConfigError
from MaxText.inference import quantize, sampling
from MaxText.inference import tokenizer as tokenizer_lib
from MaxText.layers import lora

log = logging.getLogger(__name__)
MIN_BUCKET = 8  # shortest prefill length compiled


class StepOutput(NamedTuple):
  tokens: jax.Array  # [B] int32: the sampled next tokens
  logprobs: jax.Array  # [B] float32: their log-probabilities under the model
  cache: Any  # the updated KV cache


class Completion(NamedTuple):
  text: str  # the generated text (without the prompt, EOS or stop string)
  tokens: list[int]  # the generated ids
  logprobs: list[float] | None  # per generated id, when asked for
  finish_reason: str  # "eos" (a stop token), "stop" (a stop string) or "length"


class Generation(NamedTuple):
  completions: list[Completion]  # one per prompt, in order
  time_to_first_token_s: float  # tokenize + prefill + first sample, wall clock
  decode_tokens_per_s: float  # tokens generated after the first, over all prompts, per second
  num_steps: int  # decode steps run after prefill

  @property
  def texts(self) -> list[str]:
    return [c.text for c in self.completions]


def prefill(
  graphdef: nnx.GraphDef, cache_length: int, params: nnx.State, tokens: jax.Array, lengths: jax.Array,
  images: jax.Array | None = None,
):  # fmt: skip
  """tokens [B, P] right-padded, lengths [B] (and images [B, N, S, S, C] for their placeholders) -> logits
  [B, P, V] and the cache of `cache_length` slots."""
  model = nnx.merge(graphdef, params)
  b, p = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
  out = model.forward(tokens, positions, segment_ids, cache=model.init_cache(b, cache_length), images=images)
  return out.logits, out.cache


def step(graphdef: nnx.GraphDef, params: nnx.State, cache: Any, tokens: jax.Array, positions: jax.Array):
  """One token per row: tokens/positions [B] -> logits [B, V] and the updated cache."""
  model = nnx.merge(graphdef, params)
  out = model.forward(tokens[:, None], positions[:, None], jnp.ones_like(tokens)[:, None], cache=cache)
  return out.logits[:, 0], out.cache


def _sampled(logits, rng, strategy, vocab, params) -> tuple[jax.Array, jax.Array]:
  """Sample among the tokenizer's `vocab` ids (embedding rows beyond it are never valid tokens)."""
  valid = logits
  if vocab < logits.shape[-1]:
    valid = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, sampling.NEG_INF)
  tokens = sampling.sample(valid, rng, strategy, params)
  # Replicated: every process reads all rows back to the host (rows of other processes' devices
  # could not be fetched in a multi-process job); [B] values, a negligible all-gather per step.
  everywhere = PartitionSpec()
  return tuple(jax.lax.with_sharding_constraint(x, everywhere) for x in (tokens, sampling.log_probs(logits, tokens)))


def prefill_and_sample(
  graphdef, cache_length, strategy, vocab, params, tokens, lengths, rng, sampling_params, images=None
):  # fmt: skip
  logits, cache = prefill(graphdef, cache_length, params, tokens, lengths, images)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
  return StepOutput(*_sampled(last, rng, strategy, vocab, sampling_params), cache)


def step_and_sample(graphdef, strategy, vocab, params, cache, tokens, lengths, index, rng, sampling_params):
  """Decode step `index` (1, 2, ...): each row's last token sits at position lengths + index - 1."""
  logits, cache = step(graphdef, params, cache, tokens, lengths + index - 1)
  return StepOutput(*_sampled(logits, jax.random.fold_in(rng, index), strategy, vocab, sampling_params), cache)


def bucket(n: int, cap: int) -> int:
  """The compiled length for n tokens: the next power of two (at least MIN_BUCKET), at most cap."""
  return min(max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()), cap)


def load_params(config: Config, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State, str]:
  """The model's graphdef and sharded parameters: load_parameters_path, else random (init_weights_seed).
  With quantization=int8w the matmul weights are int8 (inference/quantize.py): quantized here from a
  float checkpoint, or restored as they are from one that save_quantized_params_path wrote. The model has
  no MTP modules (state.for_inference), whatever mtp_num_layers the checkpoint was trained with.
  Under LoRA (lora_rank > 0) the adapters of lora_weights_path are merged into the base kernels here, before
  any int8w quantization: the served model is the plain one (lora_rank=0) and decoding costs nothing extra."""
  quantize.check(config)
  config_checks.check_lora_serving(config)
  served = serving_config(state_lib.for_inference(config))  # adapters merged (a run Config)
  path = config.load_parameters_path
  with sharding.activate(config, mesh):
    # int8w serves int8 params (below) through plain matmuls: no training-time (QAT) wrapper on the model.
    plain = served.replace(quantization="")
    spec = state_lib.param_spec(plain, mesh, planner.build(plain, mesh, decoding=True))
    source = path or "random weights (no load_parameters_path)"
    if path and quantize.is_quantized_checkpoint(path):
      if lora.enabled(config):
        raise ConfigError(
          f"load_parameters_path={path} holds int8 weights, which adapters cannot be merged into: give the float "
          "base (quantization=int8w quantizes it after merging), or lora_rank=0"
        )
      params, source = quantize.load_saved(served, spec), f"{source} (int8 weights, as saved)"
    else:
      params, source = _float_params(config, served, spec, mesh, source)
      if config.quantization == "int8w":
        params = quantize.for_serving(served, spec, params)
        source = f"{source} (matmul weights quantized to int8)"
  return spec.graphdef, _cast_floats(params, jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype)), source


def _float_params(
  config: Config, served: Config, spec: state_lib.ParamSpec, mesh: Mesh, source: str
) -> tuple[nnx.State, str]:
  """The served model's float params and where they came from: the checkpoint, random weights, or under
  LoRA the base with the adapters folded in (checkpointing.load_lora_merged)."""
  if lora.enabled(config):
    params = checkpointing.load_lora_merged(state_lib.for_inference(config).replace(quantization=""), mesh)
    return params, f"{source} + LoRA adapters {config.lora_weights_path or '(fresh)'}, merged"
  path = config.load_parameters_path
  params = checkpointing.load_params(path, spec.abstract, config) if path else state_lib.init_params(served, spec)
  return params, source


def _cast_floats(params: nnx.State, dtype: jnp.dtype, weight_dtype: jnp.dtype) -> nnx.State:
  """Every matmul casts its weights to dtype anyway: cast the float params once, not on every decode step.
  int8 weights keep their float32 scales (they are applied in float32 when dequantizing)."""
  if dtype == weight_dtype:
    return params

  def cast(x):
    return x if quantize.is_qarray(x) or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

  return jax.jit(lambda p: jax.tree.map(cast, p, is_leaf=quantize.is_qarray))(params)


class Engine:
  """A loaded model: call generate() as often as needed; compiled programs are reused.

  With tokenizer None, prompts are lists of token ids, completions carry ids only and nothing stops at EOS.
  """

  def __init__(self, config: Config, mesh: Mesh, graphdef: nnx.GraphDef, params: nnx.State, tokenizer, source: str):
    self.config, self.mesh, self.graphdef, self.params = config, mesh, graphdef, params
    self.tokenizer, self.source = tokenizer, source
    self._compiled: dict[tuple, Callable] = {}

  @classmethod
  def load(cls, config: Config, mesh: Mesh | None = None, tokenizer=None) -> Engine:
    mesh = sharding.create_mesh(config) if mesh is None else mesh
    graphdef, params, source = load_params(config, mesh)
    tokenizer = tokenizer_lib.for_decoding(config) if tokenizer is None else tokenizer
    log.info("Loaded %s; tokenizer %s", source, tokenizer.path)
    return cls(config, mesh, graphdef, params, tokenizer, source)

  @property
  def plan(self) -> Any:
    """The run plan the model was built with (parallel/plan.py; its graphdef holds it)."""
    return nnx.merge(self.graphdef, self.params).plan

  @property
  def batch_shards(self) -> int:
    return math.prod(self.mesh.shape[a] for a in sharding.data_axes(self.config))

  def program(self, kind: str, *static) -> Callable:
    """The jitted "prefill" (prefill_and_sample; static: cache length, strategy, vocab) or "step"
    (step_and_sample; static: strategy, vocab) program, compiled once per static arguments."""
    key = (kind, *static)
    if key not in self._compiled:
      if kind == "prefill":
        fn = jax.jit(functools.partial(prefill_and_sample, self.graphdef, *static))
      else:  # the cache is donated: each step updates it in place
        fn = jax.jit(functools.partial(step_and_sample, self.graphdef, *static), donate_argnums=(1,))
      self._compiled[key] = fn
    return self._compiled[key]

  def encode(self, prompt: str | Sequence[int], images: Sequence[Any] = ()) -> list[int]:
    """Token ids of a prompt (BOS first when add_bos); a list of ids is taken as is. A text with `images` is
    written as the family's processor writes it first (data/images.processor_text: Gemma 3's blank lines)."""
    if not isinstance(prompt, str):
      return [int(i) for i in prompt]
    if self.tokenizer is None:
      raise ConfigError("This Engine has no tokenizer: give prompts as lists of token ids")
    prompt = images_lib.processor_text(prompt, len(images), self.config, self.tokenizer)[0] if images else prompt
    bos = [self.tokenizer.bos_id] if self.config.add_bos and self.tokenizer.bos_id >= 0 else []
    return bos + self.tokenizer.encode(prompt)

  def lengths(self, ids: list[list[int]], max_new_tokens: int) -> tuple[int, int, int]:
    """(prefill length, cache length, new tokens) for these prompts; errors say what to change."""
    c = self.config
    longest = max(len(x) for x in ids)
    if min(len(x) for x in ids) == 0:
      raise ConfigError("An empty prompt (and add_bos=false): give at least one token")
    if max(max(x) for x in ids) >= c.vocab_size or min(min(x) for x in ids) < 0:
      raise ConfigError(f"A prompt holds a token id outside [0, vocab_size={c.vocab_size})")
    if longest > c.max_prefill_predict_length:
      raise ConfigError(
        f"A prompt has {longest} tokens, more than max_prefill_predict_length={c.max_prefill_predict_length}: "
        "shorten it or raise max_prefill_predict_length"
      )
    if longest >= c.max_target_length:
      raise ConfigError(f"A prompt has {longest} tokens; max_target_length={c.max_target_length} leaves no room")
    new = min(max_new_tokens, c.max_target_length - longest)
    if new < 1:
      raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prefill_len = bucket(longest, c.max_prefill_predict_length)
    # From the config and max_new_tokens only, so that the decode step compiles once for every prompt.
    cache_len = max(bucket(c.max_prefill_predict_length + max_new_tokens, c.max_target_length), prefill_len)
    new = min(new, cache_len - longest)
    if new < max_new_tokens:  # before anything compiles; the completions' finish_reason is "length"
      log.warning(
        "max_new_tokens=%d (decode_max_new_tokens), but max_target_length=%d leaves room for %d after the longest "
        "prompt's %d tokens: generating at most %d (set max_target_length=%d for all of them)",
        max_new_tokens, c.max_target_length, new, longest, new, longest + max_new_tokens,
      )  # fmt: skip
    return prefill_len, cache_len, new

  def _with_images(
    self, ids: list[list[int]], images: Sequence[Sequence[Any]]
  ) -> tuple[list[list[int]], list[np.ndarray]]:  # fmt: skip
    """Each prompt's ids with its images' blocks (data/images.expand) and its images' tiles [n, S, S, 3]."""
    if len(images) != len(ids):
      raise ConfigError(f"images: {len(images)} lists for {len(ids)} prompts; give one list per prompt")
    bos = self.tokenizer.bos_id if self.tokenizer is not None else -1
    c, out_ids, out_tiles = self.config, [], []
    size = (0, c.image_size_for_vit, c.image_size_for_vit, 3)
    for i, (x, row) in enumerate(zip(ids, images)):
      prepared = [images_lib.prepare(image, c, f"prompt {i}, image {j}") for j, image in enumerate(row)]
      out_ids.append(images_lib.expand(x, [p.tokens for p in prepared], c, f"prompt {i}", bos))
      out_tiles.append(np.concatenate([p.tiles for p in prepared]) if prepared else np.zeros(size, np.float32))
    return out_ids, out_tiles

  def _pixels(self, tiles: list[np.ndarray], rows: int) -> jax.Array:
    """float32 [rows, N, S, S, 3] (N: the most tiles of a prompt; zeros where a row has fewer), on the mesh."""
    size = self.config.image_size_for_vit
    out = np.zeros((rows, max(1, max(len(x) for x in tiles)), size, size, 3), np.float32)
    for i, row in enumerate(tiles):
      out[i, : len(row)] = row
    return jax.device_put(out, sharding.input_sharding(self.config, self.mesh, rank=5))

  def place(self, ids: list[list[int]], prefill_len: int) -> tuple[jax.Array, jax.Array]:
    """Right-padded tokens [B', P] and lengths [B'], B' a multiple of the batch shards, on the mesh."""
    rows = -(-len(ids) // self.batch_shards) * self.batch_shards
    tokens = np.zeros((rows, prefill_len), np.int32)
    lengths = np.ones((rows,), np.int32)  # padding rows: one token
    for i, x in enumerate(ids):
      tokens[i, : len(x)], lengths[i] = x, len(x)
    return (
      jax.device_put(tokens, sharding.input_sharding(self.config, self.mesh)),
      jax.device_put(lengths, sharding.input_sharding(self.config, self.mesh, rank=1)),
    )

  def sampling_params(
    self, temperature: float | None = None, top_k: int | None = None, nucleus_p: float | None = None
  ) -> sampling.SamplingParams:
    """The sampling options as the programs take them; unset ones from decode_sampling_*."""
    c = self.config
    return sampling.SamplingParams(
      jnp.float32(c.decode_sampling_temperature if temperature is None else temperature),
      jnp.int32(c.decode_sampling_top_k if top_k is None else top_k),
      jnp.float32(c.decode_sampling_nucleus_p if nucleus_p is None else nucleus_p),
    )

  def generate(
    self,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int | None = None,
    *,
    strategy: str | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    nucleus_p: float | None = None,
    stop_tokens: Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    seed: int | None = None,
    callback: Callable[[int, int], None] | None = None,
    logprobs: bool = False,
    images: Sequence[Sequence[Any]] | None = None,
  ) -> Generation:
    """Continue each prompt (text, or a list of token ids) by up to max_new_tokens tokens.

    Unset options come from the config (decode_max_new_tokens, decode_sampling_*, decode_seed).
    stop_tokens default to the tokenizer's EOS. callback(prompt index, token id) streams every
    generated token as soon as it is sampled (tokens of a stop string included; EOS not).
    images (use_multimodal models): per prompt a list of images (file paths, local or gs://; PIL images;
    uint8 arrays [H, W, 3]); each goes where the prompt has its family's image marker (Gemma 3:
    image_start_token_id; Llama 4: image_global_token_id, <|image|>), else before the text (data/images.expand);
    they are resized to image_size_for_vit (Llama 4: tiled, data/images.py).
    """
    c = self.config
    strategy = strategy or c.decode_sampling_strategy
    params = self.sampling_params(temperature, top_k, nucleus_p)
    rng = jax.random.key(c.decode_seed if seed is None else seed)
    eos = [self.tokenizer.eos_id] if self.tokenizer is not None and self.tokenizer.eos_id >= 0 else []
    rows = _Rows(len(prompts), self.tokenizer, set(eos if stop_tokens is None else stop_tokens), stop_strings)
    start = time.perf_counter()
    ids = [self.encode(p, images[i] if images is not None and i < len(images) else ()) for i, p in enumerate(prompts)]
    tiles = None
    if images is not None:
      ids, tiles = self._with_images(ids, images)
    new_tokens = c.decode_max_new_tokens if max_new_tokens is None else max_new_tokens
    prefill_len, cache_len, new = self.lengths(ids, new_tokens)
    with sharding.activate(c, self.mesh):
      tokens, lengths = self.place(ids, prefill_len)
      vocab = c.vocab_size if self.tokenizer is None else min(c.vocab_size, self.tokenizer.vocab_size)
      pixels = None if tiles is None else self._pixels(tiles, tokens.shape[0])
      out = self.program("prefill", cache_len, strategy, vocab)(self.params, tokens, lengths, rng, params, pixels)
      step_fn = self.program("step", strategy, vocab)
      ttft, steps = None, 0
      for i in range(new):
        pending = None
        if i + 1 < new:  # dispatch the next step before reading this one's tokens back
          pending = step_fn(self.params, out.cache, out.tokens, lengths, np.int32(i + 1), rng, params)
          steps += 1
        rows.record(np.asarray(out.tokens), np.asarray(out.logprobs), callback)
        ttft = time.perf_counter() - start if ttft is None else ttft
        if rows.all_done or pending is None:
          break
        out = pending
    elapsed = time.perf_counter() - start - ttft
    return Generation(rows.completions(logprobs), ttft, len(prompts) * steps / max(elapsed, 1e-9), steps)


class _Rows:
  """Per-prompt generated tokens and stop conditions, checked on the host after each step."""

  def __init__(self, n: int, tokenizer, stop_tokens: set[int], stop_strings: Sequence[str]):
    self.tokenizer, self.stop_tokens, self.stop_strings = tokenizer, stop_tokens, [s for s in stop_strings if s]
    self.tokens: list[list[int]] = [[] for _ in range(n)]
    self.logprobs: list[list[float]] = [[] for _ in range(n)]
    self.finish = ["length"] * n
    self.done = [False] * n

  @property
  def all_done(self) -> bool:
    return all(self.done)

  def record(self, tokens: np.ndarray, logprobs: np.ndarray, callback) -> None:
    for i in range(len(self.tokens)):
      if self.done[i]:
        continue
      token = int(tokens[i])
      if token in self.stop_tokens:
        self.done[i], self.finish[i] = True, "eos"
        continue
      self.tokens[i].append(token)
      self.logprobs[i].append(float(logprobs[i]))
      if callback is not None:
        callback(i, token)
      if self.stop_strings and any(s in self.text(i) for s in self.stop_strings):
        self.done[i], self.finish[i] = True, "stop"

  def text(self, i: int) -> str:
    return "" if self.tokenizer is None else self.tokenizer.decode(self.tokens[i])

  def completions(self, with_logprobs: bool) -> list[Completion]:
    out = []
    for i, tokens in enumerate(self.tokens):
      text = self.text(i)
      if self.finish[i] == "stop":
        text = text[: min(text.find(s) for s in self.stop_strings if s in text)]
      out.append(Completion(text, tokens, self.logprobs[i] if with_logprobs else None, self.finish[i]))
    return out
