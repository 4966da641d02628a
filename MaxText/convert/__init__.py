"""Hugging Face <-> MaxText checkpoint conversion (safetensors <-> orbax params)."""
