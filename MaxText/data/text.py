"""dataset_type=text: local files (a glob, or the Python standard library's sources) -> packed batches.

A .txt (or any other) file is one document; each line of a .jsonl file and each row of a .parquet file is
one document, its text in the `text_column` field.

Cold start: list the files, train a tokenizer on the training documents (unless tokenizer_path is set),
tokenize every document once and cache the tokens as .npy files in tokenizer_dir. Warm start: load the
cached tokenizer and memory-map the cached tokens. After that a batch is numpy indexing (packing.py).
Only process 0 trains and writes; the others wait for it and read the files.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from MaxText import paths, sharding
from MaxText.config import Config
from MaxText.data import files
from MaxText.data import tokenizer as tokenizers
from MaxText.data.batches import BatchIterator, Iterators
from MaxText.data.packing import DocumentRows
from MaxText.errors import DataError

log = logging.getLogger(__name__)
CACHE_FORMAT = 2  # bump when the cached token layout changes
# With a gs:// tokenizer_dir, how long the other processes wait (after the barrier that follows process 0's
# work) for its tokenizer or token cache to appear in the bucket before they stop with one line.
PUBLISH_WAIT_S = 120.0
ENCODE_CHUNK = 256  # documents per tokenizer call: bounds the memory held in Python lists
read_document = files.read_document  # how this backend reads one file (benchmarks/data_benchmark.py times it)


class Documents(NamedTuple):
  paths: list[str]  # sorted absolute paths
  root: str  # the eval split hashes paths relative to this, so it survives moving the corpus
  strict: bool  # raise on undecodable files (user corpora); False skips them (the stdlib has a few on purpose)


def list_documents(config: Config) -> Documents:
  """The files of the corpus: `dataset_path` (glob, `**` recursive) or the stdlib's *.py files."""
  if config.dataset_path:
    pattern = os.path.expanduser(config.dataset_path)
    found = sorted(paths.absolute(p) for p in files.matching(pattern))
    if not found:
      raise DataError(f"dataset_path={config.dataset_path!r} matches no files (for a directory, use 'dir/**/*.txt')")
    docs = Documents(found, paths.glob_root(pattern), strict=True)
  else:
    root = sysconfig.get_paths()["stdlib"]
    docs = Documents(_stdlib_sources(root), root, strict=False)
  if config.text_max_documents > 0:
    docs = docs._replace(paths=docs.paths[: config.text_max_documents])
  return docs


def _stdlib_sources(root: str) -> list[str]:
  paths = []
  for directory, subdirs, names in os.walk(root):
    subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")]
    paths.extend(os.path.join(directory, name) for name in names if name.endswith(".py"))
  return sorted(paths)


def document_names(docs: Documents, counts: np.ndarray) -> list[str]:
  """A stable name per document: the path relative to `docs.root`, plus `#i` inside multi-document files."""
  names = []
  for path, count in zip(docs.paths, counts):
    rel = os.path.relpath(path, docs.root)
    names.extend([rel] if not path.endswith(files.MULTI_DOCUMENT) else [f"{rel}#{i}" for i in range(count)])
  return names


def split_documents(
  docs: Documents, names: Sequence[str], nonempty: np.ndarray, eval_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
  """(train ids, eval ids) among the non-empty documents; raises DataError when there is no training data.

  The eval documents are the round(eval_fraction * n) (at least one when eval_fraction > 0 and n > 1)
  with the smallest hash of their `document_names`: fixed by the corpus, not by order or seed.
  """
  ids = np.flatnonzero(nonempty)
  if len(ids) == 0:
    raise DataError(f"The corpus is empty: all {len(names)} documents under {docs.root!r} have no text")
  n_eval = min(len(ids) - 1, max(int(eval_fraction > 0), round(eval_fraction * len(ids))))
  rank = sorted(ids, key=lambda i: hashlib.sha256(names[i].encode()).digest())
  eval_ids = np.array(sorted(rank[:n_eval]), dtype=np.int64)
  return np.setdiff1d(ids, eval_ids), eval_ids


def _sync(name: str) -> None:
  """Barrier across processes (a no-op for one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def get_tokenizer(config: Config, train_texts: Callable[[], Sequence[str]]) -> tokenizers.Tokenizer:
  """tokenizer_path, or the one cached in tokenizer_dir, or (process 0) one trained on `train_texts()`.

  A gs:// tokenizer_dir is trained into a local directory (local_dir_for) and published to the bucket; the
  other processes wait for it there (PUBLISH_WAIT_S) and fetch a local copy."""
  if config.tokenizer_path:
    return tokenizers.load_for_config(config)
  if config.tokenizer_type != "sentencepiece":
    raise DataError(f"tokenizer_type={config.tokenizer_type} needs tokenizer_path (only SentencePiece is trained)")
  published = paths.join(config.tokenizer_dir, tokenizers.MODEL_FILE)
  local_dir = paths.local_dir_for(config.tokenizer_dir)
  if jax.process_index() == 0 and not paths.isfile(published):
    start = time.perf_counter()
    path = tokenizers.train_sentencepiece(train_texts(), config.vocab_size, local_dir, config.data_shuffle_seed)
    # Uploaded when tokenizer_dir is remote; the model file last: its presence marks a complete tokenizer.
    paths.publish([os.path.join(local_dir, "tokenizer.vocab"), path], config.tokenizer_dir)
    seconds = time.perf_counter() - start
    log.info("Trained a tokenizer (vocab_size=%d) in %.1f s: %s", config.vocab_size, seconds, published)
  _sync("maxtext_data_tokenizer")
  if not paths.wait_published(published, PUBLISH_WAIT_S, "The tokenizer"):
    raise DataError(
      f"Process {jax.process_index()} cannot see the tokenizer {published!r} that process 0 trained: put "
      "base_output_directory on a filesystem all hosts share (or a gs:// bucket), or set tokenizer_path"
    )
  return tokenizers.load_for_config(config.replace(tokenizer_path=published))


class Texts(NamedTuple):
  texts: list[str]  # every document of every file, in file order
  counts: np.ndarray  # [files] int64: documents per file


class Corpus(NamedTuple):
  tokens: np.ndarray  # [total] every document's tokens back to back (with BOS/EOS); uint16 or int32
  offsets: np.ndarray  # [documents + 1] int64; document d is tokens[offsets[d]:offsets[d + 1]], empty if no text
  counts: np.ndarray  # [files] int64: documents per file (see document_names)


def _cache_prefix(config: Config, docs: Documents, tok: tokenizers.Tokenizer) -> str:
  """Cache file prefix keyed by everything the tokens depend on (files by path, size and mtime)."""
  with open(tok.path, "rb") as f:
    key = [CACHE_FORMAT, hashlib.sha256(f.read()).hexdigest(), config.add_bos, config.add_eos, docs.strict]
  key += [config.tokenizer_type, config.text_column]
  key += [[path, *paths.version_key(path)] for path in docs.paths]
  digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]
  return paths.join(config.tokenizer_dir, f"corpus-{digest}")


def tokenize_documents(config: Config, tok: tokenizers.Tokenizer, texts: Texts) -> Corpus:
  """Encode each text (+ BOS/EOS per config); whitespace-only texts become empty documents."""
  dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
  bos, eos = [tok.bos_id] * config.add_bos, [tok.eos_id] * config.add_eos
  parts, lengths = [], []
  for i in range(0, len(texts.texts), ENCODE_CHUNK):
    chunk = texts.texts[i : i + ENCODE_CHUNK]
    encoded = tok.encode_batch([t if t.strip() else "" for t in chunk])
    encoded = [bos + ids + eos if ids else [] for ids in encoded]
    lengths.extend(map(len, encoded))
    parts.append(np.fromiter(itertools.chain.from_iterable(encoded), dtype, sum(map(len, encoded))))
  offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
  return Corpus(np.concatenate(parts) if parts else np.zeros(0, dtype), offsets, texts.counts)


def load_corpus(config: Config, docs: Documents, tok: tokenizers.Tokenizer, texts: Callable[[], Texts]) -> Corpus:
  """The tokenized corpus, from the cache in tokenizer_dir or tokenized (by process 0) and cached. A gs://
  cache is written locally, published to the bucket and memory-mapped from a local copy."""
  prefix = _cache_prefix(config, docs, tok)
  local = os.path.join(paths.local_dir_for(paths.dirname(prefix)), os.path.basename(prefix))  # prefix when local
  marker = prefix + ".offsets.npy"  # written last: its presence marks a complete cache
  if jax.process_index() == 0 and not paths.isfile(marker):
    start = time.perf_counter()
    corpus = tokenize_documents(config, tok, texts())
    _save(local, corpus)
    paths.publish([f"{local}.{name}.npy" for name in ("tokens", "counts", "offsets")], paths.dirname(prefix))
    seconds = time.perf_counter() - start
    log.info("Tokenized %d documents (%d tokens) in %.1f s", len(corpus.offsets) - 1, len(corpus.tokens), seconds)
  _sync("maxtext_data_corpus")
  if not paths.wait_published(marker, PUBLISH_WAIT_S, "The tokenized corpus"):
    return tokenize_documents(config, tok, texts())  # hosts without a shared filesystem tokenize for themselves
  for name in ("offsets", "tokens", "counts"):  # fetched into `local` when remote; already there when local
    paths.local_copy(f"{prefix}.{name}.npy")
  loaded = {
    name: np.load(f"{local}.{name}.npy", mmap_mode="r" if name == "tokens" else None) for name in Corpus._fields
  }
  return Corpus(**loaded)


def _save(prefix: str, corpus: Corpus) -> None:
  """Write tokens, counts, then offsets (their presence marks a complete cache), each atomically."""
  os.makedirs(os.path.dirname(prefix), exist_ok=True)
  for name in ("tokens", "counts", "offsets"):
    tmp = f"{prefix}.{os.getpid()}.tmp.npy"
    np.save(tmp, getattr(corpus, name))
    os.replace(tmp, f"{prefix}.{name}.npy")


def read_all(config: Config, docs: Documents) -> Texts:
  """Every document of the corpus; DataError naming a file that cannot be read or lacks text_column. Undecodable
  files of a corpus read leniently (the stdlib holds a few test files on purpose) are counted in one line."""
  skipped: list[str] = []
  per_file = [files.read_texts(p, docs.strict, config.text_column, skipped) for p in docs.paths]
  if skipped:
    log.info(
      "Skipped %d file%s that do not decode as text (e.g. %s)",
      len(skipped), "" if len(skipped) == 1 else "s", os.path.relpath(skipped[0], docs.root),
    )  # fmt: skip
  return Texts(list(itertools.chain.from_iterable(per_file)), np.array([len(t) for t in per_file], np.int64))


def _warn_if_smaller_than_a_batch(config: Config, corpus: Corpus, train_ids: np.ndarray, rows: int, batch: int) -> None:
  """A training split of fewer `rows` than one step's `batch` trains (each step sees it several times over), but a
  user who pointed dataset_path at the wrong files should hear of it before anything compiles."""
  if rows >= batch or jax.process_index() != 0:
    return
  tokens = int(np.sum(corpus.offsets[train_ids + 1] - corpus.offsets[train_ids]))
  log.warning(
    "The training split is %d document%s of %d tokens in all: %d row%s of max_target_length=%d, fewer than one "
    "step's %d rows, so every batch repeats it; is dataset_path=%r the corpus you meant?",
    len(train_ids), "" if len(train_ids) == 1 else "s", tokens, rows, "" if rows == 1 else "s",
    config.max_target_length, batch, config.dataset_path,
  )  # fmt: skip


def make_iterators(config: Config, mesh: Mesh) -> Iterators:
  """Train (shuffled per epoch) and eval (fixed order) iterators over the corpus, and its tokenizer."""
  docs = list_documents(config)
  # Read only if a tokenizer or the token cache must be built, and then only once.
  texts = functools.cache(lambda: read_all(config, docs))

  def train_texts() -> list[str]:
    all_texts = texts()
    nonempty = np.array([bool(t.strip()) for t in all_texts.texts])
    train_ids, _ = split_documents(docs, document_names(docs, all_texts.counts), nonempty, config.eval_fraction)
    return [all_texts.texts[i] for i in train_ids]

  tok = get_tokenizer(config, train_texts)
  corpus = load_corpus(config, docs, tok, texts)
  names = document_names(docs, corpus.counts)
  train_ids, eval_ids = split_documents(docs, names, np.diff(corpus.offsets) > 0, config.eval_fraction)
  if config.eval_interval > 0 and not len(eval_ids):
    raise DataError(
      f"eval_interval={config.eval_interval} but eval_fraction={config.eval_fraction} holds out no document of "
      f"the {len(train_ids)} under {docs.root!r}; add documents, raise eval_fraction, or set eval_interval=-1"
    )
  spec, length = sharding.input_sharding(config, mesh), config.max_target_length

  def iterator(ids: np.ndarray, seed: int | None, batch: int, one_epoch: bool = False) -> BatchIterator:
    rows = DocumentRows(corpus.tokens, corpus.offsets, ids, length, config.packing, seed)
    return BatchIterator(rows, spec, batch, length, num_rows=rows.rows_per_epoch if one_epoch else None)

  batch = sharding.global_batch_size(config, mesh)
  train_rows = DocumentRows(corpus.tokens, corpus.offsets, train_ids, length, config.packing, config.data_shuffle_seed)
  _warn_if_smaller_than_a_batch(config, corpus, train_ids, train_rows.rows_per_epoch, batch)
  train = BatchIterator(train_rows, spec, batch, length)
  eval_batch = sharding.global_batch_size(config, mesh, config.eval_per_device_batch_size or None)
  eval_factory = (lambda: iterator(eval_ids, None, eval_batch, config.eval_steps == -1)) if len(eval_ids) else None
  return Iterators(train, eval_factory, tok, first_words(corpus, tok, eval_ids if len(eval_ids) else train_ids))


def first_words(corpus: Corpus, tok: tokenizers.Tokenizer, ids: np.ndarray, words: int = 6) -> str | None:
  """The first `words` words of the first of documents `ids` that has any (held-out ones: text the model has not
  trained on), on one line: a prompt in the data's own style for the closing summary's decode command."""
  for i in ids[:16]:
    start = corpus.offsets[i]
    found = tok.decode(corpus.tokens[start : min(start + 8 * words, corpus.offsets[i + 1])]).split()[:words]
    if found:
      return " ".join(found)
  return None
