"""Llama 2 / 3 / 3.1, Mistral, Mixtral, Qwen3: the shared pre-norm layer (layers/decoder_layer.py)
with RMSNorm; what differs between them is config only (RoPE base and llama3 scaling, sliding window,
num_experts for MoE, use_qk_norm), so they share this family."""

from __future__ import annotations

from MaxText.layers.decoder import Family
from MaxText.layers.decoder_layer import DecoderLayer

FAMILY = Family(mtp_layer=DecoderLayer)  # multi-token prediction comes for free with the plain layer
