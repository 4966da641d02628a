"""objective=dpo | simpo | orpo: preference pairs -> batches whose rows hold whole (chosen, rejected) pairs.

A record (a .jsonl line, a .parquet or Hugging Face dataset row) is either
  {"prompt", "chosen", "rejected"}: the prompt a string (one user turn) or a list of messages, each completion a
      string (one assistant turn) or a list of messages; or
  {"chosen": [messages], "rejected": [messages]}: two whole conversations; the messages they share from the start
      are the prompt, the assistant turns after it each side's completion.
Each side is rendered and tokenized as use_sft renders a conversation (chat.py: the tokenizer's chat template,
sft_chat_template; string prompt and replies without a template as plain text, chat.tokenize_plain), sources, eval
split and packing are use_sft's (sft.py). A pair is one sft.Examples entry,
its chosen tokens then its rejected ones; a row then holds whole pairs, pair k as segments 2k - 1 (chosen) and 2k
(rejected), each segment its own sequence (positions from 0; attention stays inside it) with loss on its
completion only, which is what dpo.pair_logps reads. A pair longer than max_target_length is cut to fit, the
longer side first; one with no completion token left on either side is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.sharding import Mesh

from MaxText.config import Config
from MaxText.data import chat, sft
from MaxText.data.batches import Iterators
from MaxText.errors import DataError

log = logging.getLogger(__name__)
SIDES = ("chosen", "rejected")
# A pair's loss_mask in sft.Examples: the completion bit (1), plus REJECTED on the rejected side's tokens.
REJECTED = 2


def sides(record: Any, where: str) -> tuple[chat.Conversation, chat.Conversation]:
  """The chosen and rejected Conversations of one record; DataError naming `where` when it is not a pair."""
  nulls = [side for side in SIDES if isinstance(record, dict) and side in record and record[side] is None]
  if nulls:
    raise DataError(
      f"{where}: {nulls[0]!r} is null; a pair needs a reply in both 'chosen' and 'rejected' (a string with 'prompt', "
      "or a list of {'role', 'content'} messages)"
    )
  if not isinstance(record, dict) or any(record.get(side) is None for side in SIDES):
    has = ", ".join(map(repr, record)) if isinstance(record, dict) else f"a {type(record).__name__}"
    raise DataError(
      f"{where} is not a preference pair (it has {has or 'no column'}); give 'chosen' and 'rejected' (and 'prompt', "
      "or whole conversations with a shared start in 'chosen' and 'rejected')"
    )
  if record.get("prompt") is not None:
    convs = [chat.conversation(record, chat.Columns("", "prompt", side), where) for side in SIDES]
  else:
    convs = [chat.conversation(record, chat.Columns(side, "", ""), where) for side in SIDES]
    shared = 0
    for a, b in zip(convs[0].messages, convs[1].messages):
      if a != b:
        break
      shared += 1
    convs = [c._replace(first_trained=shared) for c in convs]
  if convs[0].messages == convs[1].messages:
    raise DataError(f"{where}: 'chosen' and 'rejected' are the same conversation; a pair needs two different replies")
  for side, conv in zip(SIDES, convs):
    completion = [m for m in conv.messages[conv.first_trained :] if m["role"] == "assistant"]
    if not completion or not any(m["content"].strip() for m in completion):
      raise DataError(
        f"{where}: the {side!r} completion is empty; every pair needs a non-empty chosen and rejected reply"
      )
  return convs[0], convs[1]


def _fit(chosen: int, rejected: int, length: int) -> tuple[int, int]:
  """The lengths a pair keeps in a row of `length` tokens: the longer side is cut first, to no less than half."""
  if chosen + rejected <= length:
    return chosen, rejected
  keep_chosen = min(chosen, max(length // 2, length - rejected))
  return keep_chosen, min(rejected, length - keep_chosen)


def encode_pairs(
  config: Config, tok: Any, template: chat.ChatTemplate, records: Iterator[sft.Record], what: str
) -> sft.Examples:
  """Every record as one sft.Examples entry: chosen tokens then rejected tokens, loss_mask 1 on completions plus
  REJECTED on the rejected side (PairRows turns that into segments); DataError when no pair is left."""
  length = config.max_target_length
  tokens, masks, dropped, start = [], [], 0, time.perf_counter()
  for where, record in records:
    convs = sides(record, where)
    if template.default and all(isinstance(record.get(k), str) for k in ("prompt", *SIDES)):  # plain text
      ends = (config.add_bos, config.add_eos)
      encoded = [chat.tokenize_plain(tok, (record["prompt"], record[s]), ends, True, f"{where} ({s})") for s in SIDES]
    else:
      encoded = [chat.tokenize(template, tok, conv, True, f"{where} ({side})") for side, conv in zip(SIDES, convs)]
    keep = _fit(len(encoded[0].tokens), len(encoded[1].tokens), length)
    if not all(ex.loss_mask[:n].any() for ex, n in zip(encoded, keep)):
      dropped += 1  # a completion starts past what fits: nothing to compare
      continue
    tokens.append(np.concatenate([ex.tokens[:n] for ex, n in zip(encoded, keep)]))
    masks.append(np.concatenate([encoded[0].loss_mask[: keep[0]], encoded[1].loss_mask[: keep[1]] + REJECTED]))
  if dropped:
    log.warning("%s: dropped %d pairs whose prompts fill max_target_length=%d", what, dropped, length)
  if not tokens:
    raise DataError(f"{what} has no preference pair whose completions fit max_target_length={length}")
  log.info("Tokenized %d preference pairs (%s) in %.1f s", len(tokens), what, time.perf_counter() - start)
  offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens], dtype=np.int64)])
  return sft.Examples(np.concatenate(tokens), np.concatenate(masks).astype(np.uint8), offsets)


class PairRows:
  """A `batches.RowSource` of whole pairs: sft.ExampleRows over encode_pairs' entries (so packing, shuffling and
  the resumable state are use_sft's), each entry split into its chosen (segment 2k - 1) and rejected (2k) side."""

  def __init__(self, examples: sft.Examples, length: int, packing: bool, seed: int | None):
    self._rows = sft.ExampleRows(examples, length, packing, seed)
    self.rows_per_epoch = self._rows.rows_per_epoch

  def rows(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
    """(tokens, segmentation, positions, loss_mask), each int32 [len(indices), length]."""
    tokens, segmentation, positions, mask = self._rows.rows(indices)
    rejected = (mask & REJECTED) != 0
    for k in range(len(tokens)):  # the rejected side's positions restart: minus its pair's chosen length
      chosen = np.bincount(segmentation[k][~rejected[k]], minlength=segmentation.shape[1] + 1)
      positions[k] -= np.where(rejected[k], chosen[segmentation[k]], 0).astype(positions.dtype)
    segmentation = np.where(segmentation > 0, 2 * segmentation - 1 + rejected, 0).astype(np.int32)
    return tokens, segmentation, positions, (mask & 1).astype(np.int32)

  def state(self, next_row: int) -> dict[str, Any]:
    return self._rows.state(next_row)

  def next_row(self, state: dict[str, Any]) -> int:
    return self._rows.next_row(state)


def make_iterators(config: Config, mesh: Mesh) -> Iterators:
  """Train (endless) and eval (in order) iterators of preference batches; see MaxText.data."""
  return sft.make_iterators(config, mesh, encode_pairs, PairRows)
