"""MaxText-style LLM training in pure Python/JAX."""
