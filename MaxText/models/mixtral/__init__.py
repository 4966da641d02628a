"""Mixtral: Llama 2's layers (models/llama2) with every feed-forward a MoE (num_experts, num_experts_per_tok)
and Mistral's sliding window."""
