"""Gemma <-> GemmaForCausalLM (model_type gemma): Llama's layout; the activation field is hidden_activation."""

from __future__ import annotations

from MaxText.convert import hf_mapping


class Gemma(hf_mapping.Mapping):
  decoder_block = "gemma"
  model_types = ("gemma",)
  arch = ("gemma", "GemmaForCausalLM")
  activation_field = "hidden_activation"


MAPPING = Gemma()
