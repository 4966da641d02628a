"""Checks of a loaded config's values that need no devices: config.load runs `validate` on every Config,
and `check_divisibility` runs again once the real mesh exists (train, state). Each failure is a
ConfigError that names the key and what to set instead. Split from config.py, which reads and merges
the values; this file says which values can run. Tested through config.load (config_test.py, presets_test.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from MaxText import chat_checks, hlo_dump, paths
from MaxText.errors import ConfigError

# mesh axis -> the suffix of its ici_/dcn_ keys (MaxText calls the `stage` axis "pipeline"). `context` is
# MaxText's name for the sequence split of attention: both `sequence` and `context` split activation_length and
# attention treats them alike (planner.py); `context` exists so MaxText command lines with
# ici_context_parallelism work, and base.yml also shards params over it.
AXIS_KEY = {
  "data": "data", "stage": "pipeline", "fsdp": "fsdp", "fsdp_transpose": "fsdp_transpose", "sequence": "sequence",
  "context": "context", "tensor": "tensor", "expert": "expert", "autoregressive": "autoregressive",
}  # fmt: skip


def check_choice(key: str, value: Any, choices: tuple[Any, ...]) -> None:
  """A ConfigError naming the key and its choices when `value` is not one of them (config.CHOICES at load, the
  model description's Literal fields when made)."""
  if value not in choices:
    raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")


def pipeline_stages(c: Any) -> int:
  """Pipeline stages: ici_pipeline_parallelism x dcn_pipeline_parallelism (a dict or a Config)."""
  return c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"]


def _validate_family_options(c: dict[str, Any]) -> None:
  """Family options (RoPE scaling, local attention, soft-caps, MoE) that cannot work as given."""
  for k in ("sliding_window_size", "attn_logits_soft_cap", "final_logits_soft_cap", "query_pre_attn_scalar"):
    if c[k] < 0:
      raise ConfigError(f"{k} must be >= 0 (0 turns it off), got {c[k]}")
  for k in ("global_head_dim", "global_num_kv_heads", "num_kv_shared_layers", "hidden_size_per_layer_input"):
    if c[k] < 0:  # gemma4's: 0 is head_dim / num_kv_heads, or off
      raise ConfigError(f"{k} must be >= 0 (0: the default, see base.yml), got {c[k]}")
  if c["global_num_kv_heads"] and c["num_query_heads"] % c["global_num_kv_heads"]:
    raise ConfigError(
      f"num_query_heads ({c['num_query_heads']}) must be a multiple of global_num_kv_heads ({c['global_num_kv_heads']})"
    )
  if c["hidden_size_per_layer_input"] and c["vocab_size_per_layer_input"] <= 0:
    raise ConfigError(f"vocab_size_per_layer_input must be > 0, got {c['vocab_size_per_layer_input']}")
  if c["rope_type"] != "default" and c["rope_factor"] < 1.0:
    raise ConfigError(f"rope_factor must be >= 1 with rope_type={c['rope_type']}, got {c['rope_factor']}")
  if c["rope_type"] == "llama3" and not 0 < c["rope_low_freq_factor"] < c["rope_high_freq_factor"]:
    raise ConfigError("rope_type=llama3 needs 0 < rope_low_freq_factor < rope_high_freq_factor")
  if c["rope_type"] == "yarn" and not (
    c["original_max_position_embeddings"] > 0 and c["rope_beta_fast"] >= c["rope_beta_slow"] > 0
  ):  # equal betas (Kimi K2: 1 and 1) leave a one-dim ramp, as transformers computes it
    raise ConfigError(
      "rope_type=yarn needs original_max_position_embeddings > 0 and rope_beta_fast >= rope_beta_slow > 0, got "
      f"{c['original_max_position_embeddings']}, {c['rope_beta_fast']}, {c['rope_beta_slow']}"
    )
  if min(c["rope_mscale"], c["rope_mscale_all_dim"], c["rope_attention_factor"]) < 0:
    raise ConfigError("rope_mscale, rope_mscale_all_dim and rope_attention_factor must be >= 0 (0: unset)")
  if c["num_experts"] < 1 or not 1 <= c["num_experts_per_tok"] <= c["num_experts"]:
    raise ConfigError(
      f"need num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, got {c['num_experts']} "
      f"and {c['num_experts_per_tok']}"
    )
  if c["capacity_factor"] < 0 or c["load_balance_loss_weight"] < 0:
    raise ConfigError("capacity_factor and load_balance_loss_weight must be >= 0")
  groups = c["n_routing_groups"]
  if groups < 1 or c["num_experts"] % groups or not 1 <= c["topk_routing_group"] <= groups:
    raise ConfigError(
      f"n_routing_groups ({groups}) must divide num_experts ({c['num_experts']}) and topk_routing_group "
      f"({c['topk_routing_group']}) must be in [1, n_routing_groups]"
    )
  if c["attention_bias"] and c["decoder_block"] == "deepseek":
    raise ConfigError("attention_bias=true is not implemented for MLA (decoder_block=deepseek)")
  if c["mlp_bias"] and c["num_experts"] > 1 and c["capacity_factor"] > 0:
    raise ConfigError("mlp_bias=true with num_experts > 1 (biased experts, gpt-oss) runs dropless: capacity_factor=0")
  if c["mlp_activations_limit"] < 0:
    raise ConfigError(f"mlp_activations_limit must be >= 0 (0: no clamped SwiGLU), got {c['mlp_activations_limit']}")
  if c["num_experts_per_tok"] > c["topk_routing_group"] * (c["num_experts"] // groups):
    raise ConfigError(
      f"num_experts_per_tok ({c['num_experts_per_tok']}) exceeds the experts of topk_routing_group "
      f"({c['topk_routing_group']}) groups of num_experts / n_routing_groups ({c['num_experts'] // groups})"
    )
  if not 0 <= c["first_num_dense_layers"] <= c["num_decoder_layers"]:
    raise ConfigError(f"first_num_dense_layers must be in [0, num_decoder_layers], got {c['first_num_dense_layers']}")
  if c["mtp_num_layers"] < 0 or c["mtp_loss_scaling_factor"] < 0:
    raise ConfigError("mtp_num_layers and mtp_loss_scaling_factor must be >= 0 (mtp_num_layers=0: no MTP)")
  if c["mtp_num_layers"] >= c["max_target_length"]:
    raise ConfigError(f"mtp_num_layers ({c['mtp_num_layers']}) must be < max_target_length ({c['max_target_length']})")
  _validate_llama4_options(c)


def _validate_llama4_options(c: dict[str, Any]) -> None:
  """Chunked attention, NoPE/MoE interleaving, temperature tuning and input-weighted routing."""
  for k in ("chunk_attn_window_size", "nope_layer_interval"):
    if c[k] < 0:
      raise ConfigError(f"{k} must be >= 0 (0 turns it off), got {c[k]}")
  if c["chunk_attn_window_size"] and c["sliding_window_size"]:
    raise ConfigError("set chunk_attn_window_size or sliding_window_size, not both (one local window per layer)")
  if c["interleave_moe_layer_step"] < 1 or c["temperature_tuning_floor_scale"] <= 0:
    raise ConfigError("interleave_moe_layer_step must be >= 1 and temperature_tuning_floor_scale > 0")
  if c["routed_weight_on_input"] and c["num_experts_per_tok"] != 1:
    raise ConfigError(
      f"routed_weight_on_input=true needs num_experts_per_tok=1 (got {c['num_experts_per_tok']}): the expert input "
      "can carry one router weight"
    )


def _validate_decoding(c: dict[str, Any]) -> None:
  if c["max_prefill_predict_length"] <= 0 or c["decode_max_new_tokens"] <= 0 or c["decode_sampling_top_k"] <= 0:
    raise ConfigError("max_prefill_predict_length, decode_max_new_tokens and decode_sampling_top_k must be > 0")
  if c["decode_sampling_temperature"] < 0 or not 0 < c["decode_sampling_nucleus_p"] <= 1:
    raise ConfigError("need decode_sampling_temperature >= 0 and 0 < decode_sampling_nucleus_p <= 1")


def _validate_pipeline(c: dict[str, Any]) -> None:
  """Pipeline keys; whether the layers split into the stages is checked where the stacks are known
  (planner.py, when the run plan is built)."""
  stages = pipeline_stages(c)
  if c["ici_pipeline_parallelism"] < 1 or c["dcn_pipeline_parallelism"] < 1:
    raise ConfigError("ici_pipeline_parallelism and dcn_pipeline_parallelism must be set (>= 1), not -1")
  micro, repeats, layers = c["num_pipeline_microbatches"], c["num_pipeline_repeats"], c["pipeline_parallel_layers"]
  if micro == 0 or micro < -1 or repeats < 1:
    raise ConfigError(f"need num_pipeline_microbatches -1 or >= 1, num_pipeline_repeats >= 1; got {micro}, {repeats}")
  if layers == 0 or layers < -1 or layers > c["num_decoder_layers"]:
    raise ConfigError(f"pipeline_parallel_layers must be -1 (all) or in [1, {c['num_decoder_layers']}], got {layers}")
  if stages == 1:
    return
  if not c["scan_layers"]:
    raise ConfigError(f"pipelining ({stages} stages) needs scan_layers=true: each stage holds a slice of the stack")
  if repeats > 1 and 0 < micro < stages:
    raise ConfigError(
      f"num_pipeline_repeats={repeats} needs num_pipeline_microbatches >= the {stages} stages, got {micro}"
    )


def _validate_tokenizer_path(c: dict[str, Any]) -> None:
  """A missing tokenizer file is an error, except on synthetic data, which never reads it: MaxText's
  recipes pass tokenizer_path=assets/tokenizer.llama2 even then, and their command lines run unchanged."""
  path = c["tokenizer_path"]
  if not path or paths.may_exist(path) or c["dataset_type"] == "synthetic":
    return
  raise ConfigError(
    f"tokenizer_path={path!r} does not exist. MaxText's assets/ tokenizers are not shipped here: use the "
    "tokenizer a Hugging Face checkpoint carries (python3 -m MaxText.convert.hf_to_maxtext copies its "
    "tokenizer.json), train one on your files (python3 -m MaxText.data.train_tokenizer), or leave "
    "tokenizer_path empty with dataset_type=text to train one on the corpus (docs/data.md)"
  )


def _validate_load_paths(c: dict[str, Any]) -> None:
  """load_parameters_path / load_full_state_path name a checkpoint directory that may exist."""
  for key in ("load_parameters_path", "load_full_state_path"):
    if c[key] and not paths.may_exist(c[key]):
      raise ConfigError(f"{key}={c[key]!r} does not exist")
    if c[key] and paths.is_local_file(c[key]):
      form = "<run dir>/checkpoints/<step>/state"
      if key == "load_parameters_path":
        form += ", or a params-only checkpoint's directory"
      raise ConfigError(f"{key}={c[key]!r} is a file, not a checkpoint directory; give {form}")


def _validate_images(c: dict[str, Any]) -> None:
  """use_multimodal: the image slots and tiles can be used as given."""
  if c["max_image_pixels"] < 1:
    raise ConfigError(f"max_image_pixels={c['max_image_pixels']} must be >= 1 (the most pixels of an image)")
  if not c["use_multimodal"]:
    return
  if c["images_per_row"] < 1 or c["image_tiles_per_row"] < 0:
    raise ConfigError(
      f"use_multimodal needs images_per_row >= 1 and image_tiles_per_row >= 0 (0: images_per_row), got "
      f"{c['images_per_row']} and {c['image_tiles_per_row']}"
    )
  if c["max_image_tiles"] < 1:  # data/images.best_grid says the same to a config built by hand
    raise ConfigError(f"max_image_tiles={c['max_image_tiles']}: an image needs at least one tile (Llama 4: 16)")
  if c["use_sft"] and not c["sft_images_column"]:
    raise ConfigError("use_sft with use_multimodal needs sft_images_column (the field with a row's images)")


def _validate_optimizer(c: dict[str, Any]) -> None:
  """Optimizer values that would train silently wrong (a negative step, a division by ~0)."""
  if c["learning_rate"] < 0:
    raise ConfigError(f"learning_rate must be >= 0, got {c['learning_rate']}; e.g. learning_rate=3e-4")
  if c["adam_eps"] <= 0 or c["adam_eps_root"] < 0:
    raise ConfigError(
      f"adam_eps must be > 0 and adam_eps_root >= 0 (they keep Adam's update finite), got {c['adam_eps']} and "
      f"{c['adam_eps_root']}; e.g. adam_eps=1e-8"
    )
  for k in ("adam_b1", "adam_b2"):
    if not 0.0 <= c[k] < 1.0:
      raise ConfigError(f"{k} must be in [0, 1), got {c[k]}")
  for k in ("adam_weight_decay", "gradient_clipping_threshold"):
    if c[k] < 0:
      raise ConfigError(f"{k} must be >= 0 (0 turns it off), got {c[k]}")
  _validate_optimizer_choice(c)
  if not 0.0 <= c["cosine_learning_rate_final_fraction"] <= 1.0:
    raise ConfigError(
      f"cosine_learning_rate_final_fraction must be in [0, 1], got {c['cosine_learning_rate_final_fraction']}"
    )


def _validate_optimizer_choice(c: dict[str, Any]) -> None:
  """The keys of the other optimizers (opt_type) and the weight-decay mask."""
  if not 0.0 <= c["muon_beta"] < 1.0:
    raise ConfigError(f"muon_beta must be in [0, 1), got {c['muon_beta']}")
  if not 0.0 < c["adafactor_decay_rate"] <= 1.0:
    raise ConfigError(f"adafactor_decay_rate must be in (0, 1], got {c['adafactor_decay_rate']}")
  for k in ("muon_weight_decay", "muon_consistent_rms", "adafactor_clipping_threshold"):
    if c[k] < 0:
      raise ConfigError(f"{k} must be >= 0 (0 turns it off), got {c[k]}")
  if c["adafactor_min_dim_size_to_factor"] < 1:
    raise ConfigError(f"adafactor_min_dim_size_to_factor must be >= 1, got {c['adafactor_min_dim_size_to_factor']}")
  _validate_router_balancing(c)
  for pattern in c["adamw_mask"]:
    if not isinstance(pattern, str):
      raise ConfigError(f"adamw_mask takes regexes over parameter paths, got {pattern!r}; e.g. adamw_mask=[norm,bias]")
    try:
      re.compile(pattern)
    except re.error as e:
      raise ConfigError(f"adamw_mask: {pattern!r} is not a regular expression ({e}); e.g. adamw_mask=[norm]") from None


def _validate_router_balancing(c: dict[str, Any]) -> None:
  """routed_bias_update_rate: what the load-driven bias update needs."""
  rate = c["routed_bias_update_rate"]
  if rate < 0:
    raise ConfigError(f"routed_bias_update_rate must be >= 0 (0 turns it off), got {rate}; DeepSeek V3: 0.001")
  if rate == 0:
    return
  if not c["routed_bias"] or c["num_experts"] <= 1:
    raise ConfigError(
      f"routed_bias_update_rate={rate} balances the experts through the router's selection bias: it needs "
      "num_experts > 1 and routed_bias=true (deepseek3 presets), or set routed_bias_update_rate=0"
    )
  if pipeline_stages(c) > 1 or c["lora_rank"] > 0:
    raise ConfigError(
      f"routed_bias_update_rate={rate} is not supported with pipeline parallelism or LoRA (the expert loads are "
      "not collected through the pipeline; LoRA freezes the bias): set routed_bias_update_rate=0"
    )


# Qwix's calibration methods and how many comma-separated numbers each takes (qwix qarray.calibrate).
CALIBRATION_ARGS = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1, 1), "fixed": (2, 2)}


def _validate_lora(c: dict[str, Any]) -> None:
  """The LoRA keys make sense (checked whether or not lora_rank turns LoRA on, like every key)."""
  if c["lora_rank"] < 0:
    raise ConfigError(f"lora_rank={c['lora_rank']} must be >= 0 (0 turns LoRA off)")
  if c["lora_alpha"] <= 0:
    raise ConfigError(f"lora_alpha={c['lora_alpha']} must be > 0")
  for key in ("lora_target_modules", "lora_vision_target_modules"):
    try:
      re.compile(c[key])
    except re.error as e:
      raise ConfigError(f"{key}={c[key]!r} is not a regular expression: {e}") from None


def _validate_quantization(c: dict[str, Any]) -> None:
  """Quantization keys that would fail inside the first traced matmul instead of here."""
  try:
    re.compile(c["quantization_modules"])
  except re.error as e:
    raise ConfigError(f"quantization_modules={c['quantization_modules']!r} is not a valid regex: {e}") from None
  method, *args = c["quantization_calibration_method"].lower().split(",")
  low, high = CALIBRATION_ARGS.get(method, (-1, -1))
  try:
    [float(a) for a in args]
  except ValueError:
    low = -1
  if not low <= len(args) <= high:
    raise ConfigError(
      f"quantization_calibration_method={c['quantization_calibration_method']!r} is not one of absmax, "
      "absmax,<clip>, minmax, minmax,<clip>, rms,<k>, fixed,<lo>,<hi> (numbers after the commas)"
    )
  if c["quantization_tile_size"] < 0:
    raise ConfigError(f"quantization_tile_size must be >= 0 (0: whole axis), got {c['quantization_tile_size']}")


def _eval_data_missing(c: dict[str, Any]) -> str:
  """Why eval_interval > 0 would evaluate nothing with this dataset_type ('' when it has eval data)."""
  kind = c["dataset_type"]
  if kind == "text" and c["eval_fraction"] == 0:
    return "eval_fraction=0 holds out no documents; set eval_fraction (e.g. 0.02)"
  if kind == "grain" and not c["grain_eval_files"]:
    return "dataset_type=grain has no grain_eval_files; set grain_eval_files"
  if kind == "hf" and not (c["hf_eval_split"] or c["hf_eval_files"]):
    return "dataset_type=hf has no hf_eval_split or hf_eval_files; set one"
  if kind == "tfds" and not c["eval_split"]:
    return "dataset_type=tfds has eval_split=''; set eval_split"
  return ""


def _validate_indexer(c: dict[str, Any]) -> None:
  """DeepSeek V3.2's lightning indexer (index_n_heads > 0) sits on MLA and reads its query latent."""
  if not c["index_n_heads"]:
    return
  if c["decoder_block"] != "deepseek" or not c["q_lora_rank"]:
    raise ConfigError(
      f"index_n_heads={c['index_n_heads']} needs decoder_block=deepseek with q_lora_rank > 0 (got "
      f"decoder_block={c['decoder_block']}, q_lora_rank={c['q_lora_rank']}); or set index_n_heads=0"
    )
  if c["index_topk"] <= 0 or c["index_head_dim"] < c["qk_rope_head_dim"]:
    raise ConfigError(
      f"the indexer needs index_topk > 0 and index_head_dim >= qk_rope_head_dim (its rope dims); got "
      f"index_topk={c['index_topk']}, index_head_dim={c['index_head_dim']}, qk_rope_head_dim={c['qk_rope_head_dim']}"
    )
  if c["ici_context_parallelism"] != 1 or c["dcn_context_parallelism"] != 1:
    raise ConfigError(
      "index_n_heads > 0 (the indexer) does not support context parallelism yet; set ici/dcn_context_parallelism=1"
    )


def _validate_head_dims(c: dict[str, Any]) -> None:
  """RoPE rotates the two halves of each head against each other, so the rotated width must be even."""
  if c["decoder_block"] == "deepseek":
    if c["qk_rope_head_dim"] <= 0 or c["qk_rope_head_dim"] % 2:
      raise ConfigError(
        f"qk_rope_head_dim must be a positive even number (RoPE pairs halves), got {c['qk_rope_head_dim']}"
      )
  elif c["decoder_block"] != "gpt3" and c["head_dim"] % 2:
    raise ConfigError(
      f"head_dim={c['head_dim']} does not split into the two halves RoPE rotates; use an even head_dim, "
      f"e.g. head_dim={c['head_dim'] + 1}"
    )


# Model dimensions whose parameters are sharded along a logical axis: (the key users set, derived key,
# logical axis in logical_axis_rules). A dimension must divide by the mesh axes its logical axis maps to.
SHARDED_DIMS = (
  ("base_emb_dim", "emb_dim", "embed"),
  ("base_num_query_heads", "num_query_heads", "heads"),
  ("base_num_kv_heads", "num_kv_heads", "kv_heads"),
  ("base_mlp_dim", "mlp_dim", "mlp"),
  ("base_moe_mlp_dim", "moe_mlp_dim", "mlp"),
  ("vocab_size", "vocab_size", "vocab"),
  ("num_experts", "num_experts", "exp"),
)


def _unused_dims(c: Any) -> set[str]:
  """Derived keys of SHARDED_DIMS that no parameter of this model has (so their sharding is moot)."""
  unused = set()
  if c["decoder_block"] == "deepseek":
    unused.add("num_kv_heads")  # MLA: keys and values come from a shared latent, one per query head
  if c["num_experts"] == 1:
    unused |= {"num_experts", "moe_mlp_dim"}
  elif c["first_num_dense_layers"] == 0 and not c["shared_experts"]:
    unused.add("mlp_dim")
  return unused


def known_axis_sizes(c: Any) -> dict[str, int]:
  """Mesh axis -> ici x dcn parallelism, for the axes whose size the config alone fixes (no -1)."""
  sizes = {}
  for axis in c["mesh_axes"]:
    ici, dcn = c[f"ici_{AXIS_KEY[axis]}_parallelism"], c[f"dcn_{AXIS_KEY[axis]}_parallelism"]
    if ici > 0 and dcn > 0:
      sizes[axis] = ici * dcn
  return sizes


def check_divisibility(c: Any, axis_sizes: Mapping[str, int]) -> None:
  """ConfigError naming the key when a sharded model dimension does not divide by its mesh axes.

  `c`: a Config or its values; `axis_sizes`: mesh axis -> size (all of them once the mesh exists, the
  known ones at load). A logical axis with several rules (embed) is checked against the mesh axes common
  to all of them, which divide whichever rule flax picks, so the check never rejects a runnable model.
  """
  rules: dict[str, list[set[str]]] = {}
  for name, target in c["logical_axis_rules"]:
    rules.setdefault(name, []).append({target} if isinstance(target, str) else set(target or ()))
  unused = _unused_dims(c)
  for user_key, key, logical in SHARDED_DIMS:
    if key in unused or logical not in rules:
      continue
    axes = sorted(set.intersection(*rules[logical]) & {a for a, n in axis_sizes.items() if n > 1})
    ways = math.prod(axis_sizes[a] for a in axes)
    if c[key] % ways:
      shown = f"{key}={c[key]}" if key == user_key else f"{key}={c[key]} (from {user_key})"
      over = " x ".join(f"{a}({axis_sizes[a]})" for a in axes)
      raise ConfigError(
        f"{shown} does not divide over the mesh axes {over} that shard its '{logical}' axis; make {user_key} "
        f"a multiple of {ways} or lower the ici_/dcn_ parallelism of {', '.join(axes)}"
      )


def validate(c: dict[str, Any]) -> None:
  """Checks that need no devices; device-dependent ones (mesh, batch) live in sharding.py."""
  _positive(c, "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim")
  _positive(c, "base_num_decoder_layers", "head_dim", "vocab_size", "max_target_length", "steps")
  _positive(c, "per_device_batch_size", "log_period", "gradient_accumulation_steps", "checkpoint_period")
  if c["num_query_heads"] % c["num_kv_heads"]:
    raise ConfigError(
      f"num_query_heads ({c['num_query_heads']}) must be a multiple of num_kv_heads ({c['num_kv_heads']})"
    )
  _validate_head_dims(c)
  _validate_indexer(c)
  _validate_family_options(c)
  _validate_decoding(c)
  _validate_pipeline(c)
  _validate_optimizer(c)
  _validate_quantization(c)
  _validate_lora(c)
  check_divisibility(c, known_axis_sizes(c))
  missing_eval = _eval_data_missing(c) if c["eval_interval"] > 0 else ""
  if missing_eval:
    raise ConfigError(f"eval_interval={c['eval_interval']} but {missing_eval}, or set eval_interval=-1")
  if len(c["mlp_activations"]) not in (1, 2):
    raise ConfigError(f"mlp_activations takes one or two activations, got {c['mlp_activations']}")
  if not 0.0 <= c["dropout_rate"] < 1.0:
    raise ConfigError(f"dropout_rate must be in [0, 1), got {c['dropout_rate']}")
  if not 0.0 <= c["warmup_steps_fraction"] <= 1.0:
    raise ConfigError(f"warmup_steps_fraction must be in [0, 1], got {c['warmup_steps_fraction']}")
  if c["load_parameters_path"] and c["load_full_state_path"]:
    raise ConfigError("Set at most one of load_parameters_path and load_full_state_path")
  _validate_load_paths(c)
  _validate_tokenizer_path(c)
  chat_checks.validate_sft(c)
  _validate_images(c)
  chat_checks.validate_preferences(c)
  _validate_data_sources(c)
  _validate_run_settings(c)
  _validate_pieces(c)


def _positive(c: dict[str, Any], *keys: str) -> None:
  for k in keys:
    if c[k] <= 0:
      raise ConfigError(f"{k} must be > 0, got {c[k]}")


def _validate_data_sources(c: dict[str, Any]) -> None:
  """Eval settings and what each dataset_type needs."""
  if c["eval_interval"] > 0 and c["eval_steps"] <= 0 and c["eval_steps"] != -1:
    raise ConfigError(f"eval_steps must be > 0 (or -1: one epoch) when eval_interval is set, got {c['eval_steps']}")
  if c["eval_steps"] == -1 and c["dataset_type"] == "synthetic":
    raise ConfigError("eval_steps=-1 evaluates one epoch, but synthetic data has none; set eval_steps > 0")
  if c["dataset_type"] == "grain" and not c["grain_train_files"]:
    raise ConfigError("dataset_type=grain needs grain_train_files (a glob, or 'glob1,0.7;glob2,0.3')")
  if c["dataset_type"] == "hf" and not c["hf_path"]:
    raise ConfigError("dataset_type=hf needs hf_path (a Hub dataset, or parquet|json|arrow with hf_train_files)")
  if c["dataset_type"] in ("grain", "tfds", "hf") and not c["tokenizer_path"]:
    raise ConfigError(f"dataset_type={c['dataset_type']} needs tokenizer_path (only dataset_type=text trains one)")
  if c["grain_worker_count"] < 0 or c["target_eval_loss"] < 0:
    raise ConfigError("grain_worker_count and target_eval_loss must be >= 0")
  if c["dataset_type"] == "text" and not 0.0 <= c["eval_fraction"] < 1.0:
    raise ConfigError(f"eval_fraction must be in [0, 1), got {c['eval_fraction']}")


def _validate_run_settings(c: dict[str, Any]) -> None:
  """Checkpoints kept, distributed timeouts, spike skipping, the async checkpoint lag."""
  if c["max_num_checkpoints_to_keep"] == 0 or c["max_num_checkpoints_to_keep"] < -1:
    raise ConfigError("max_num_checkpoints_to_keep must be -1 (keep all) or a positive number")
  _positive(c, "compile_topology_num_slices", "jax_distributed_initialization_timeout")
  _positive(c, "jax_distributed_heartbeat_timeout")
  _positive(c, "skip_step_interval", "skip_step_scaling_factor")
  if c["async_checkpoint_max_lag_steps"] < 0:
    raise ConfigError(f"async_checkpoint_max_lag_steps must be >= 0, got {c['async_checkpoint_max_lag_steps']}")


def _validate_pieces(c: dict[str, Any]) -> None:
  """How the loss, flash attention, the MLP and the query are cut into pieces; the HLO dump."""
  tiles = c["num_vocab_tiling"]
  if tiles == 0 or tiles < -1 or (tiles > 0 and c["max_target_length"] % tiles):
    raise ConfigError(
      f"num_vocab_tiling={tiles} must be -1 (auto) or a positive divisor of max_target_length={c['max_target_length']}"
    )
  for key in ("flash_pieces", "mlp_pieces"):
    if c[key] == 0 or c[key] < -1:
      raise ConfigError(f"{key}={c[key]} must be -1 (auto) or a positive number of parts")
  hlo_dump.check_keys(c)
  chunk, length = c["attention_query_chunk"], c["max_target_length"]
  if chunk < 0 or (chunk and length > chunk and length % chunk):
    raise ConfigError(
      f"attention_query_chunk={chunk} must be 0 (off) or divide max_target_length={length}; "
      f"e.g. attention_query_chunk={math.gcd(length, 512)}"
    )


def check_lora_serving(c: Any) -> None:
  """Decoding or scoring a LoRA fine-tune needs its adapters: ConfigError when none are named (the keys'
  values themselves are checked at load, _validate_lora)."""
  if c.lora_rank > 0 and not c.lora_weights_path and not c.lora_random_base:
    raise ConfigError(
      f"lora_rank={c.lora_rank} serves a LoRA fine-tune: set lora_weights_path to its adapters (a LoRA run's "
      "checkpoints/<step>/state), or lora_rank=0 to serve load_parameters_path alone"
    )
