"""SentencePiece tokenizers: load one, or train one on a corpus.

Trained tokenizers are BPE with byte fallback (any text encodes; decode(encode(x)) == x), identity
normalisation and no whitespace folding, so source code keeps its indentation and newlines. Ids: pad 0,
bos 1, eos 2, unk 3. Padding is a control piece that encode() never emits; segment ids mark padding.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_FILE = "tokenizer.model"
# Training "sentences" are runs of this many lines, so pieces can learn to end in a newline.
LINES_PER_SENTENCE = 8
# Sentences sampled for training: the bound on training time (the Python stdlib has ~100k; ~10 s on 2 cores).
MAX_SENTENCES = 200_000


class Tokenizer:
  """A SentencePiece model: text <-> lists of int ids."""

  def __init__(self, path: str):
    self.path = path
    self._sp = spm.SentencePieceProcessor(model_file=path)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def pad_id(self) -> int:
    """-1 when the model defines no padding piece (e.g. Llama's)."""
    return self._sp.pad_id()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """encode() of each text, on all CPU cores."""
    return self._sp.encode(list(texts), num_threads=os.cpu_count() or 1)

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """Text of `ids`; control ids (pad, bos, eos) decode to nothing."""
    return self._sp.decode([int(i) for i in ids])


def load_tokenizer(path: str) -> Tokenizer:
  """The SentencePiece model at `path`; ValueError naming the path when it is missing or not a model."""
  if not os.path.isfile(path):
    raise ValueError(f"Tokenizer {path!r} does not exist; set tokenizer_path to a SentencePiece .model file")
  try:
    return Tokenizer(path)
  except (RuntimeError, OSError) as e:
    raise ValueError(f"Tokenizer {path!r} is not a SentencePiece model: {e}") from None


def _sentences(texts_or_files: Iterable[str | os.PathLike]) -> Iterator[str]:
  for item in texts_or_files:
    if isinstance(item, os.PathLike):
      with open(item, encoding="utf-8") as f:
        item = f.read()
    lines = item.splitlines(keepends=True)
    for i in range(0, len(lines), LINES_PER_SENTENCE):
      chunk = "".join(lines[i : i + LINES_PER_SENTENCE])
      if chunk.strip():
        yield chunk


def train_sentencepiece(
  texts_or_files: Iterable[str | os.PathLike], vocab_size: int, output_dir: str, seed: int = 0
) -> str:
  """Train a BPE model of at most `vocab_size` pieces; returns `<output_dir>/tokenizer.model`.

  Items are texts (str) or files to read as UTF-8 (os.PathLike). At most MAX_SENTENCES runs of
  LINES_PER_SENTENCE lines, sampled uniformly, are used. The vocabulary may come out smaller than
  `vocab_size` on a small corpus. The model appears atomically, so concurrent readers never see half a file.
  """
  os.makedirs(output_dir, exist_ok=True)
  prefix = os.path.join(output_dir, f".tokenizer-{uuid.uuid4().hex}")
  seen = [0]

  def counted():
    for s in _sentences(texts_or_files):
      seen[0] += 1
      yield s

  spm.set_random_generator_seed(seed)
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=counted(),
      model_prefix=prefix,
      vocab_size=vocab_size,
      model_type="bpe",
      byte_fallback=True,
      hard_vocab_limit=False,
      input_sentence_size=MAX_SENTENCES,
      shuffle_input_sentence=True,
      max_sentence_length=1 << 14,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      allow_whitespace_only_pieces=True,
      pad_id=PAD_ID,
      bos_id=BOS_ID,
      eos_id=EOS_ID,
      unk_id=UNK_ID,
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
    )
  except RuntimeError as e:
    if seen[0] == 0:
      raise ValueError("No text to train a tokenizer on: every document is empty") from None
    raise ValueError(f"Training a SentencePiece tokenizer with vocab_size={vocab_size} failed: {e}") from None
  path = os.path.join(output_dir, MODEL_FILE)
  os.replace(prefix + ".vocab", os.path.join(output_dir, "tokenizer.vocab"))
  os.replace(prefix + ".model", path)
  return path
