"""use_sft=true: chat/instruction examples -> batches whose loss covers the completion tokens only.

Sources: dataset_type=text reads `dataset_path` (a glob of .jsonl/.json files, one example per line, and
.parquet files, one per row; eval: eval_fraction of the examples, by hash); dataset_type=hf reads a Hugging Face
dataset (hf_path=json|parquet|arrow with hf_train_files for local files; eval: hf_eval_split/hf_eval_files).
Each example is rendered with the chat template and tokenized once, in memory, by every process (chat.py);
examples longer than max_target_length keep their first max_target_length tokens (and are dropped when no
completion token is left). Packing puts whole examples into rows (next fit, in an order fixed by
data_shuffle_seed), never splitting one, so a completion always sees its prompt; each epoch visits the rows in
a new order. A row is then indexing into the packed layout, so the iterator state is a row number as for text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import Mesh

from MaxText import paths, sharding
from MaxText.config import Config
from MaxText.data import chat, files, hf_data, image_records
from MaxText.data import images as images_lib
from MaxText.data import tokenizer as tokenizers
from MaxText.data.batches import BatchIterator, Iterators
from MaxText.errors import DataError

log = logging.getLogger(__name__)
PACK_SALT = 0x5F7  # seeds the fixed packing order apart from the per-epoch row orders (which use epoch >= 0)
Record = tuple[str, Any]  # (where: "file:line" or "split row i", for messages; the record: a dict)


class Examples(NamedTuple):
  tokens: np.ndarray  # int32 [total]: every example's tokens back to back
  loss_mask: np.ndarray  # uint8 [total]: 1 for completion tokens
  offsets: np.ndarray  # int64 [examples + 1]: example e is tokens[offsets[e]:offsets[e + 1]]
  # use_multimodal: per example where it came from (for errors) and its images (image_records.row_images:
  # paths, encoded images, Hugging Face dataset references); None: text only
  images: list[tuple[str, list[Any]]] | None = None
  image_size: int = 0  # image_size_for_vit
  images_per_row: int = 0  # tile slots per row (images_lib.slots_per_row)
  tiles: np.ndarray | None = None  # int64 [examples]: each example's tiles (None: one per image)
  tiler: Callable[[Any, str], np.ndarray] | None = None  # (image, where) -> float32 [n, S, S, 3]; None: one square


class ExampleRows:
  """A `batches.RowSource` over whole examples: rows of `length` tokens, each one example (packing=false) or as
  many consecutive examples of a fixed order as fit (packing=true); rows per epoch R is fixed, so row n is row
  n % R of epoch n // R. `seed` None: rows in order every epoch (evaluation)."""

  def __init__(self, examples: Examples, length: int, packing: bool, seed: int | None):
    self._ex, self._length, self._seed = examples, length, seed
    lengths = np.minimum(np.diff(examples.offsets), length)
    n = len(lengths)
    order = np.arange(n) if seed is None else np.random.default_rng([seed, PACK_SALT]).permutation(n)
    counts = np.zeros(n, np.int64) if examples.images is None else np.array([len(p) for _, p in examples.images])
    counts = counts if examples.tiles is None else examples.tiles
    starts, fill, images = [], length, 0
    for i, e in enumerate(order):  # next fit: a new row when the example (or its images) does not fit the current one
      if not packing or fill + lengths[e] > length or images + counts[e] > examples.images_per_row:
        starts.append(i)
        fill, images = 0, 0
      fill += lengths[e]
      images += counts[e]
    self._order, self._lengths = order, lengths
    self._row_starts = np.array(starts + [n], np.int64)
    self.rows_per_epoch = len(starts)
    self._cached: tuple[int, np.ndarray | None] = (-1, None)

  def _row_order(self, epoch: int) -> np.ndarray:
    if self._cached[0] != epoch:
      r = self.rows_per_epoch
      perm = np.arange(r) if self._seed is None else np.random.default_rng([self._seed, epoch]).permutation(r)
      self._cached = (epoch, perm)
    return self._cached[1]

  def rows(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
    """(tokens, segmentation, positions, loss_mask), each int32 [len(indices), length]; with images, also
    float32 pixels [len(indices), slots, S, S, 3] (slots: images_per_row), each image's tiles in order, decoded
    and resized here (zeros for empty slots)."""
    out = [np.zeros((len(indices), self._length), np.int32) for _ in range(4)]
    tokens, segmentation, positions, mask = out
    ex = self._ex
    pixels = None
    if ex.images is not None:
      pixels = np.zeros((len(indices), ex.images_per_row, ex.image_size, ex.image_size, 3), np.float32)
    for k, n in enumerate(np.asarray(indices, np.int64)):
      epoch, row = divmod(int(n), self.rows_per_epoch)
      r = self._row_order(epoch)[row]
      col, slot = 0, 0
      for segment, e in enumerate(self._order[self._row_starts[r] : self._row_starts[r + 1]], 1):
        if pixels is not None:
          where, row_images = ex.images[e]
          for image in row_images:
            if ex.tiler:
              tiles = ex.tiler(image, where)
            else:
              tiles = image_records.pixels(image, ex.image_size, where)[None]
            if slot + len(tiles) > pixels.shape[1]:  # only when a file changed after it was tokenized
              raise DataError(f"an image of {where} now has more tiles than when the data was tokenized")
            pixels[k, slot : slot + len(tiles)] = tiles
            slot += len(tiles)
        start, size = self._ex.offsets[e], self._lengths[e]
        tokens[k, col : col + size] = self._ex.tokens[start : start + size]
        mask[k, col : col + size] = self._ex.loss_mask[start : start + size]
        segmentation[k, col : col + size] = segment
        positions[k, col : col + size] = np.arange(size)
        col += size
    return (tokens, segmentation, positions, mask) + (() if pixels is None else (pixels,))

  def state(self, next_row: int) -> dict[str, Any]:
    epoch, row = divmod(next_row, self.rows_per_epoch)
    return {"epoch": epoch, "row": row, "rows_per_epoch": self.rows_per_epoch}

  def next_row(self, state: dict[str, Any]) -> int:
    if state.get("rows_per_epoch") != self.rows_per_epoch:
      raise DataError(
        f"Data state {state} was saved for {state.get('rows_per_epoch')} rows per epoch, but these SFT examples "
        f"make {self.rows_per_epoch}: the data, tokenizer, chat template, max_target_length or packing changed; "
        "restore them or start a new run_name"
      )
    return int(state["epoch"]) * self.rows_per_epoch + int(state["row"])


def file_records(path: str) -> Iterator[Record]:
  """The records of a .jsonl/.json (one JSON object per line) or .parquet (one per row) file."""
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq

    try:
      table = pq.read_table(paths.local_copy(path))  # a remote file fetched: pyarrow reads local ones
    except (OSError, ValueError) as e:
      raise DataError(f"Cannot read Parquet file {path!r}: {e}") from None
    for i, row in enumerate(table.to_pylist()):
      yield f"{path} row {i}", row
    return
  if not path.endswith((".jsonl", ".json")):
    raise DataError(f"use_sft reads .jsonl/.json/.parquet files, not {path!r}; convert it or narrow dataset_path")
  for number, line in enumerate(files.read_document(path, strict=True).splitlines(), 1):
    if line.strip():
      try:
        yield f"{path}:{number}", json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{number} is not a JSON object: {e}") from None


def hf_records(config: Config, split: str, data_files: str) -> Iterator[Record]:
  """The rows of a Hugging Face dataset split; an Image column (sft_images_column) is not decoded here: its
  rows hold references to their images (image_records.HfImage), read when a batch is built."""
  dataset = hf_data.load_split(config, split, data_files)
  column = config.sft_images_column
  dataset, images = image_records.split_hf_images(dataset, column)
  for i, row in enumerate(dataset):
    if images is not None:
      row[column] = images[i]
    yield f"hf_path={config.hf_path!r} split {split!r} row {i}", row


def encode(config: Config, tok: Any, template: chat.ChatTemplate, records: Iterator[Record], what: str) -> Examples:
  """Every record as an Example, truncated to max_target_length; DataError when none has a completion left."""
  columns = chat.Columns(config.sft_messages_column, config.sft_prompt_column, config.sft_completion_column)
  only, length = config.sft_train_on_completion_only, config.max_target_length
  tokens, masks, dropped, start = [], [], 0, time.perf_counter()
  pictures, tile_counts = ([], []) if config.use_multimodal else (None, None)
  for where, record in records:
    row_images = image_records.row_images(record, config.sft_images_column, where)
    for image in row_images if config.use_multimodal else ():  # each one, before anything compiles
      image_records.check(image, config.max_image_pixels, where)
    rewrite = functools.partial(images_lib.processor_text, images=len(row_images), config=config, tok=tok)
    text = chat.plain(record, columns) if template.default else None
    if text is not None:  # strings without a chat template: plain text
      ex = chat.tokenize_plain(tok, text, (config.add_bos, config.add_eos), only, where, rewrite)
    else:
      ex = chat.tokenize(template, tok, chat.conversation(record, columns, where), only, where, rewrite)
    ids, loss_mask = ex.tokens, ex.loss_mask
    if row_images or config.use_multimodal:
      blocks, n_tiles = _image_blocks(config, row_images, where)
      ids, loss_mask = images_lib.expand_with_mask(ids, loss_mask, blocks, config, where)
      ids, loss_mask = np.asarray(ids, np.int32), np.asarray(loss_mask, np.uint8)
    if not loss_mask[:length].any():
      dropped += 1  # its completion starts past max_target_length: nothing to learn from it
      continue
    tokens.append(ids[:length])
    masks.append(loss_mask[:length])
    if pictures is not None:
      pictures.append((where, row_images))
      tile_counts.append(n_tiles)
  if dropped:
    log.warning("%s: dropped %d examples whose prompt fills max_target_length=%d", what, dropped, length)
  if not tokens:
    raise DataError(f"{what} has no example with a completion within max_target_length={length}")
  log.info("Tokenized %d SFT examples (%s) in %.1f s", len(tokens), what, time.perf_counter() - start)
  offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens], dtype=np.int64)])
  if pictures is None:
    return Examples(np.concatenate(tokens), np.concatenate(masks), offsets)
  tiler = functools.partial(_tiles, config)
  slots, size = images_lib.slots_per_row(config), config.image_size_for_vit
  return Examples(
    np.concatenate(tokens), np.concatenate(masks), offsets, pictures, size, slots, np.array(tile_counts), tiler
  )


def _image_blocks(config: Config, row_images: list[Any], where: str) -> tuple[list[list[int]] | int, int]:
  """(each image's block of tokens, the example's tiles); a count of images for a text model (expand's error)."""
  if not config.use_multimodal:
    return len(row_images), 0
  if len(row_images) > config.images_per_row:
    raise DataError(f"{where} has {len(row_images)} images, more than images_per_row={config.images_per_row}")
  squares = images_lib.scheme(config) is images_lib.SQUARE  # no image is read to lay out a square one
  resolved = row_images if squares else [image_records.resolved(im, where) for im in row_images]
  layouts = [images_lib.layout(im, config, where) for im in resolved]
  n_tiles, slots = sum(n for _, n in layouts), images_lib.slots_per_row(config)
  if n_tiles > slots:
    raise DataError(
      f"{where}: its {len(row_images)} image(s) make {n_tiles} tiles, more than the {slots} tile slots of a row; "
      f"raise image_tiles_per_row (or lower max_image_tiles)"
    )
  return [b for b, _ in layouts], n_tiles


def _tiles(config: Config, image: Any, where: str) -> np.ndarray:
  return images_lib.prepare(image_records.resolved(image, where), config, where).tiles


def _split_by_hash(records: list[Record], eval_fraction: float) -> tuple[list[Record], list[Record]]:
  """(train, eval): the round(eval_fraction * n) records (at least one when eval_fraction > 0 and n > 1) with the
  smallest hash of their location, so the split is fixed by the data, not by its order."""
  n_eval = min(len(records) - 1, max(int(eval_fraction > 0), round(eval_fraction * len(records))))
  rank = sorted(range(len(records)), key=lambda i: hashlib.sha256(records[i][0].encode()).digest())
  held = set(rank[: max(n_eval, 0)])
  return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def load_examples(
  config: Config, tok: Any, template: chat.ChatTemplate, encode: Callable[..., Examples] = encode
) -> tuple[Examples, Examples | None]:
  """(train, eval or None) examples of the configured source, each record made an Example by `encode` (objective=dpo:
  preferences.encode_pairs)."""
  if config.dataset_type == "hf":
    train = encode(config, tok, template, hf_records(config, config.train_split, config.hf_train_files), "train")
    if not (config.hf_eval_split or config.hf_eval_files):
      return train, None
    split, data_files = (config.hf_eval_split, "") if config.hf_eval_split else ("eval", config.hf_eval_files)
    return train, encode(config, tok, template, hf_records(config, split, data_files), "eval")
  pattern = os.path.expanduser(config.dataset_path)
  found = files.matching(pattern)
  if not found:
    raise DataError(f"dataset_path={config.dataset_path!r} matches no files (e.g. dataset_path='/data/chat/*.jsonl')")
  records = [r for path in found for r in file_records(path)]
  if not records:
    raise DataError(f"dataset_path={config.dataset_path!r} holds no examples")
  train, held = _split_by_hash(records, config.eval_fraction)
  train_ex = encode(config, tok, template, iter(train), f"dataset_path={config.dataset_path!r}")
  return train_ex, encode(config, tok, template, iter(held), "the held-out examples") if held else None


def make_iterators(
  config: Config, mesh: Mesh, encode: Callable[..., Examples] = encode, rows_of: Callable[..., Any] = ExampleRows
) -> Iterators:
  """Train (endless, row order reshuffled per epoch) and eval (in order) iterators; see MaxText.data. objective=dpo
  passes its own `encode` and `rows_of` (a RowSource like ExampleRows): data/preferences.py."""
  tok = tokenizers.load_tokenizer(config.tokenizer_path, config.tokenizer_type)
  tokenizers.check_tokenizer(tok, config.vocab_size, add_bos=False, add_eos=False)  # the template places BOS/EOS
  template = chat.load_template(tok, config.sft_chat_template)
  train, held = load_examples(config, tok, template, encode)
  if config.eval_interval > 0 and held is None:
    raise DataError(f"eval_interval={config.eval_interval} but no example is held out; add examples or eval data")
  spec, length = sharding.input_sharding(config, mesh), config.max_target_length

  def iterator(examples: Examples, seed: int | None, batch: int, one_epoch: bool = False) -> BatchIterator:
    rows = rows_of(examples, length, config.packing, seed)
    return BatchIterator(rows, spec, batch, length, num_rows=rows.rows_per_epoch if one_epoch else None)

  train_it = iterator(train, config.data_shuffle_seed, sharding.global_batch_size(config, mesh))
  eval_batch = sharding.global_batch_size(config, mesh, config.eval_per_device_batch_size or None)
  eval_factory = (lambda: iterator(held, None, eval_batch, config.eval_steps == -1)) if held is not None else None
  return Iterators(train_it, eval_factory, tok)
