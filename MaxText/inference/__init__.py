"""Decoding: KV-cache prefill and generation (engine.py), sampling (sampling.py), and the generate() API.

from MaxText.inference import Engine
engine = Engine.load(config)            # once: mesh, parameters (checkpoint or random), tokenizer
result = engine.generate(["def ", "import os"], max_new_tokens=32)
"""

from MaxText.inference.engine import Completion, Engine, Generation

__all__ = ["Completion", "Engine", "Generation"]
