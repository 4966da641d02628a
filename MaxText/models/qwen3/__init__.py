"""Qwen3 and Qwen3-MoE: Llama 2's layers (models/llama2) with q/k RMSNorms (use_qk_norm); the MoE models
route top-k of a softmax (norm_topk_prob) in every layer."""
