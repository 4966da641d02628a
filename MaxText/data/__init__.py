"""Input pipeline: `make_iterators(config, mesh)` -> endless iterators of global, sharded batches.

A batch is a dict of int32 jax.Arrays [global_batch, max_target_length] placed with
`sharding.input_sharding(config, mesh)`; keys in `batches.FIELDS`. Iterators have `get_state()` (JSON)
and `set_state(state)`, which replays exactly the batches that followed `get_state()`.
"""

from __future__ import annotations

import importlib

from jax.sharding import Mesh

from MaxText.chat_checks import PREFERENCE_OBJECTIVES
from MaxText.config import DATASET_BACKENDS, Config
from MaxText.data import preferences, sft
from MaxText.data.batches import FIELDS, BatchIterator, BatchSource, Iterators
from MaxText.data.tokenizer import Tokenizer
from MaxText.errors import DataError

__all__ = ["FIELDS", "BatchIterator", "BatchSource", "Iterators", "Tokenizer", "make_iterators"]


def make_iterators(config: Config, mesh: Mesh) -> Iterators:
  """Train iterator (endless), eval factory (fresh iterator per call; None without eval data), tokenizer."""
  if config.dataset_type not in DATASET_BACKENDS:
    raise DataError(f"dataset_type={config.dataset_type!r} is not one of {', '.join(sorted(DATASET_BACKENDS))}")
  if config.objective in PREFERENCE_OBJECTIVES:  # pairs, rendered as use_sft renders chats (data/preferences.py)
    return preferences.make_iterators(config, mesh)
  if config.use_sft:  # chat/instruction examples, loss on the completion (data/sft.py reads text or hf sources)
    return sft.make_iterators(config, mesh)
  return importlib.import_module(DATASET_BACKENDS[config.dataset_type]).make_iterators(config, mesh)
