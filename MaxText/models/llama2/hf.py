"""Llama 2 / 3 / 3.1 <-> LlamaForCausalLM (model_type llama): the shared layers' own layout, plus the biases
transformers' Llama can carry."""

from __future__ import annotations

from MaxText.convert import hf_mapping


class Llama(hf_mapping.Mapping):
  decoder_block = "llama2"
  model_types = ("llama",)
  arch = ("llama", "LlamaForCausalLM")
  biases = ("attention_bias", "mlp_bias")


MAPPING = Llama()
