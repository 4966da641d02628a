"""Tokenizers (SentencePiece, tiktoken BPE, Hugging Face tokenizer.json): load one, or train a SentencePiece one.

All share one interface: vocab_size, bos_id, eos_id, pad_id (-1 when absent), encode, encode_batch, decode.
Trained SentencePiece tokenizers are BPE with byte fallback (any text encodes; decode(encode(x)) == x), identity
normalisation and no whitespace folding, so source code keeps its indentation and newlines. Ids: pad 0,
bos 1, eos 2, unk 3. Padding is a control piece that encode() never emits; segment ids mark padding.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

from MaxText import paths
from MaxText.errors import DataError

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
MODEL_FILE = "tokenizer.model"
# Training "sentences" are runs of this many lines, so pieces can learn to end in a newline.
LINES_PER_SENTENCE = 8
# Sentences sampled for training: the bound on training time (the Python stdlib has ~100k; ~10 s on 2 cores).
MAX_SENTENCES = 200_000


class Tokenizer:
  """A SentencePiece model: text <-> lists of int ids. The other tokenizers follow its interface."""

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

  def token_text(self, token_id: int) -> str:
    """The piece of `token_id` ("" for -1): how a prompt writes a special token."""
    return self._sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else ""


def load_tokenizer(path: str, tokenizer_type: str = "sentencepiece") -> Tokenizer:
  """The tokenizer at `path`; DataError naming the path when it is missing or not of `tokenizer_type`.

  sentencepiece: a .model file; tiktoken: a BPE ranks file (Llama 3's tokenizer.model); huggingface: a
  tokenizer.json file or a directory holding one.
  """
  if tokenizer_type not in LOADERS:
    raise DataError(f"tokenizer_type={tokenizer_type!r} is not one of {', '.join(LOADERS)}")
  if not paths.probe_exists(path, f"Tokenizer {path!r}"):
    raise DataError(f"Tokenizer {path!r} does not exist; set tokenizer_path to a {tokenizer_type} tokenizer file")
  path = paths.local_copy(path)  # the tokenizer libraries open local files only
  try:
    return LOADERS[tokenizer_type](path)
  except Exception as e:  # each library raises its own types
    raise DataError(f"Tokenizer {path!r} is not a {tokenizer_type} tokenizer: {e}") from None


def check_tokenizer(tok: Tokenizer, vocab_size: int, add_bos: bool, add_eos: bool) -> None:
  """DataError when the model's embedding cannot hold the tokenizer's ids, or a wanted BOS/EOS is missing."""
  if tok.vocab_size > vocab_size:
    raise DataError(
      f"Tokenizer {tok.path!r} has {tok.vocab_size} pieces but vocab_size={vocab_size}: "
      f"raise vocab_size to at least {tok.vocab_size}"
    )
  for flag, wanted, piece_id in (("add_bos", add_bos, tok.bos_id), ("add_eos", add_eos, tok.eos_id)):
    if wanted and piece_id < 0:
      raise DataError(f"Tokenizer {tok.path!r} has no {flag[4:].upper()} piece; set {flag}=false")


def load_for_config(config) -> Tokenizer:
  """config.tokenizer_path as config.tokenizer_type, checked against vocab_size, add_bos and add_eos."""
  tok = load_tokenizer(config.tokenizer_path, config.tokenizer_type)
  check_tokenizer(tok, config.vocab_size, config.add_bos, config.add_eos)
  return tok


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
      raise DataError("No text to train a tokenizer on: every document is empty") from None
    raise DataError(f"Training a SentencePiece tokenizer with vocab_size={vocab_size} failed: {e}") from None
  path = os.path.join(output_dir, MODEL_FILE)
  os.replace(prefix + ".vocab", os.path.join(output_dir, "tokenizer.vocab"))
  os.replace(prefix + ".model", path)
  return path


# Llama 3's pre-tokenizer split (tiktoken format); other tiktoken files use the same in practice.
LLAMA3_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
  r"\s+(?!\S)|\s+"
)
# Llama 3's 256 special tokens follow the BPE ranks in this order; reserved ones fill the gaps.
LLAMA3_SPECIAL = [
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|reserved_special_token_0|>",
  "<|reserved_special_token_1|>",
]
LLAMA3_SPECIAL += ["<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>"]
LLAMA3_SPECIAL += ["<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
NUM_LLAMA3_SPECIAL = 256


class TiktokenTokenizer(Tokenizer):
  """A tiktoken BPE ranks file (base64 token, rank per line), Llama 3 style: 256 special tokens after the ranks.

  BOS is <|begin_of_text|>, EOS <|end_of_text|>; special-token text in documents is encoded as plain text.
  """

  def __init__(self, path: str):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    self.path = path
    ranks = load_tiktoken_bpe(path)
    reserved = range(2, 2 + NUM_LLAMA3_SPECIAL - len(LLAMA3_SPECIAL))
    names = LLAMA3_SPECIAL + [f"<|reserved_special_token_{i}|>" for i in reserved]
    self._special = {name: len(ranks) + i for i, name in enumerate(names)}
    name = os.path.basename(path)
    self._enc = tiktoken.Encoding(name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=self._special)

  @property
  def vocab_size(self) -> int:
    return self._enc.n_vocab

  @property
  def bos_id(self) -> int:
    return self._special["<|begin_of_text|>"]

  @property
  def eos_id(self) -> int:
    return self._special["<|end_of_text|>"]

  @property
  def pad_id(self) -> int:
    return -1

  def encode(self, text: str) -> list[int]:
    return self._enc.encode(text, disallowed_special=())

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._enc.encode_batch(list(texts), num_threads=os.cpu_count() or 1, disallowed_special=())

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    specials = set(self._special.values())
    return self._enc.decode([int(i) for i in ids if int(i) not in specials])


# Names Hugging Face tokenizers use for their BOS/EOS tokens, tried in order without a tokenizer_config.json.
HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
HF_EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")


class HuggingFaceTokenizer(Tokenizer):
  """A Hugging Face `tokenizers` tokenizer.json (or a directory holding it, and maybe tokenizer_config.json).

  BOS/EOS come from tokenizer_config.json's bos_token/eos_token when present, else from common token names.
  The tokenizer's own post-processor (which may add BOS) is not applied: add_bos/add_eos decide.
  """

  def __init__(self, path: str):
    import tokenizers

    self.path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    self._tok = tokenizers.Tokenizer.from_file(self.path)
    named = _hf_special_names(os.path.dirname(self.path))
    self._bos = self._first_id((named.get("bos_token"), *HF_BOS))
    self._eos = self._first_id((named.get("eos_token"), *HF_EOS))
    self._pad = self._first_id((named.get("pad_token"), "<pad>", "[PAD]"))

  def _first_id(self, names: Sequence[str | None]) -> int:
    for name in names:
      if name and self._tok.token_to_id(name) is not None:
        return self._tok.token_to_id(name)
    return -1

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def bos_id(self) -> int:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def pad_id(self) -> int:
    return self._pad

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """encode(text) and each token's (start, end) character span in `text` (chat.py masks by span)."""
    encoding = self._tok.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets

  def token_text(self, token_id: int) -> str:
    """The vocabulary entry of `token_id` ("" for -1): how a chat template writes a special token."""
    return (self._tok.id_to_token(token_id) or "") if token_id >= 0 else ""


def _hf_special_names(directory: str) -> dict[str, str]:
  """bos_token/eos_token/pad_token from tokenizer_config.json (strings or {"content": ...}), if present."""
  import json

  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    cfg = json.load(f)
  names = {}
  for key in ("bos_token", "eos_token", "pad_token"):
    value = cfg.get(key)
    names[key] = value.get("content") if isinstance(value, dict) else value
  return names


# tokenizer_type -> class taking the tokenizer path.
LOADERS = {"sentencepiece": Tokenizer, "tiktoken": TiktokenTokenizer, "huggingface": HuggingFaceTokenizer}
