"""The checks of the chat-data and preference keys (use_sft, sft_*, objective=dpo | simpo | orpo and their keys),
run by config_checks.validate on every loaded config: each failure is one ConfigError naming the key."""

from __future__ import annotations

import os
from typing import Any

from MaxText.errors import ConfigError

# The objectives whose batches are preference pairs (data/preferences.py).
PREFERENCE_OBJECTIVES = ("dpo", "simpo", "orpo")


def validate_sft(c: dict[str, Any]) -> None:
  """use_sft (and the preference objectives) read chat examples from text files or a Hugging Face dataset, with
  the tokenizer of the model; a chat template is a Hugging Face tokenizer's."""
  pairs = c["objective"] in PREFERENCE_OBJECTIVES
  if not (c["use_sft"] or pairs):
    return
  key = f"objective={c['objective']}" if pairs else "use_sft=true"
  if c["dataset_type"] not in ("text", "hf") or (c["dataset_type"] == "text" and not c["dataset_path"]):
    raise ConfigError(
      f"{key} reads dataset_type=text with dataset_path (a glob of .jsonl/.parquet files) or dataset_type=hf; "
      f"got dataset_type={c['dataset_type']} dataset_path={c['dataset_path']!r}"
    )
  if not c["tokenizer_path"]:
    raise ConfigError(
      f"{key} needs tokenizer_path: the model's tokenizer (a converted checkpoint's config.yml sets it; for a model "
      "pre-trained here, <its run directory>/tokenizer/tokenizer.model)"
    )
  if c["sft_chat_template"] and c["tokenizer_type"] != "huggingface":
    raise ConfigError(
      f"sft_chat_template needs tokenizer_type=huggingface (got {c['tokenizer_type']}); with this tokenizer give "
      "plain 'prompt' and 'completion' (or 'chosen'/'rejected') strings, which need no template"
    )
  if c["sft_chat_template"] and not os.path.isfile(os.path.expanduser(c["sft_chat_template"])):
    raise ConfigError(f"sft_chat_template={c['sft_chat_template']!r} does not exist; give a Jinja2 template file")


def validate_preferences(c: dict[str, Any]) -> None:
  """The DPO, SimPO and ORPO keys make sense (checked whatever the objective, like every key)."""
  if c["dpo_beta"] <= 0:
    raise ConfigError(f"dpo_beta={c['dpo_beta']} must be > 0 (e.g. dpo_beta=0.1)")
  if not 0.0 <= c["dpo_label_smoothing"] < 0.5:
    raise ConfigError(f"dpo_label_smoothing={c['dpo_label_smoothing']} must be in [0, 0.5)")
  if c["simpo_beta"] <= 0:
    raise ConfigError(f"simpo_beta={c['simpo_beta']} must be > 0 (SimPO's recipes: 2.0 to 2.5)")
  if c["simpo_gamma"] < 0:
    raise ConfigError(f"simpo_gamma={c['simpo_gamma']} must be >= 0 (the target margin; e.g. 0.5 * simpo_beta)")
  if c["orpo_lambda"] < 0:
    raise ConfigError(f"orpo_lambda={c['orpo_lambda']} must be >= 0 (the odds-ratio term's weight; e.g. 0.1)")
  if c["objective"] not in PREFERENCE_OBJECTIVES:
    return
  key = f"objective={c['objective']}"
  if c["use_sft"]:
    raise ConfigError(f"{key} and use_sft=true: a run trains one objective; set use_sft=false")
  if c["mtp_num_layers"] > 0:
    raise ConfigError(f"{key} does not train multi-token prediction: set mtp_num_layers=0")
