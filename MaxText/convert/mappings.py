"""The Hugging Face mapping of a model, looked up in the family registry (models.HF: each family folder's hf.py):
by decoder_block for an export, by config.json's model_type for an import. A model without one is a ConfigError."""

from __future__ import annotations

from typing import Any

from MaxText import models
from MaxText.convert.hf_mapping import Mapping
from MaxText.errors import ConfigError


def of_block(decoder_block: str) -> Mapping:
  """The mapping of `decoder_block`; ConfigError naming the blocks that have one."""
  if decoder_block not in models.HF:
    supported = ", ".join(models.HF)
    raise ConfigError(f"decoder_block {decoder_block!r} has no Hugging Face export; supported: {supported}")
  return models.HF[decoder_block]


def of_config_json(hf: dict[str, Any]) -> Mapping:
  """The mapping that reads a config.json, by its model_type (a multimodal one, gemma3 or llama4, included)."""
  model_type = hf.get("model_type")
  for mapping in models.HF.values():
    if model_type and (model_type in mapping.model_types or model_type == mapping.multimodal_type):
      return mapping
  if model_type in NOT_YET:
    raise ConfigError(f"model_type={model_type!r}: {NOT_YET[model_type]}")
  types = [t for m in models.HF.values() for t in (*m.model_types, m.multimodal_type) if t]
  raise ConfigError(f"Unsupported architecture model_type={model_type!r}; supported: {', '.join(types)}")


# Released architectures this project knows of and does not build yet, with why (docs/models.md, "Not yet").
NOT_YET = {
  "deepseek_v4": "DeepSeek V4 is not supported yet (compressed sparse attention, hyper-connections and hash-routed "
  "experts are not built; docs/models.md, 'Not yet')",
}
