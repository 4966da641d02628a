"""Mistral <-> MistralForCausalLM (model_type mistral): Llama's layout plus the sliding window."""

from __future__ import annotations

from MaxText.convert import hf_mapping


class Mistral(hf_mapping.Mapping):
  decoder_block = "mistral"
  model_types = ("mistral",)
  arch = ("mistral", "MistralForCausalLM")
  biases = ()
  extra = {"sliding_window": "sliding_window_size"}


MAPPING = Mistral()
