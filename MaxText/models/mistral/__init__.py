"""Mistral: Llama 2's layers (models/llama2) with a sliding window on every layer (sliding_window_size)."""
