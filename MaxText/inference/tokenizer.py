"""The tokenizer for decoding: tokenizer_path, else the one a text run cached in its run directory,
else UTF-8 bytes (ids = byte + 3 after pad 0, bos 1, eos 2, like the trained SentencePiece models), so
a model with random weights or one trained on token ids still decodes without any file."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from MaxText import paths
from MaxText.config import Config
from MaxText.data import tokenizer as tokenizers
from MaxText.errors import ConfigError

log = logging.getLogger(__name__)


class ByteTokenizer:
  """UTF-8 bytes as tokens: id = byte + 3; pad 0, bos 1, eos 2; ids outside the bytes decode to nothing."""

  path = "<utf-8 bytes>"
  vocab_size, pad_id, bos_id, eos_id = 259, 0, 1, 2
  OFFSET = 3

  def encode(self, text: str) -> list[int]:
    return [b + self.OFFSET for b in text.encode("utf-8")]

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.OFFSET + 256)
    return data.decode("utf-8", errors="replace")


def for_decoding(config: Config):
  """tokenizer_path, else <run dir>/tokenizer/tokenizer.model (trained by a text run), else bytes."""
  cached = paths.join(config.tokenizer_dir, tokenizers.MODEL_FILE)
  if config.tokenizer_path:
    tok = tokenizers.load_tokenizer(config.tokenizer_path, config.tokenizer_type)
  elif paths.isfile(cached):
    tok = tokenizers.load_tokenizer(cached)
  else:
    log.warning("No tokenizer_path and no tokenizer cached in %s: using UTF-8 bytes as tokens", config.tokenizer_dir)
    tok = ByteTokenizer()
  if tok.vocab_size > config.vocab_size and not isinstance(tok, ByteTokenizer):  # bytes: sampling is limited
    raise ConfigError(f"Tokenizer {tok.path!r} has {tok.vocab_size} pieces but vocab_size={config.vocab_size}")
  return tok
