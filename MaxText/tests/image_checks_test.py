"""Every image of a vision SFT dataset is checked when the rows are tokenized, before anything compiles: a missing,
damaged (garbage, a truncated PNG or JPEG) or oversized image (max_image_pixels, default Pillow's 89.5 MP) is one
line naming the row and the file, without decoding the pixels of the good ones."""

import io
import json
import os
import struct
import types
import zlib

import numpy as np
import pytest

from MaxText import config
from MaxText.data import chat, images, sft
from MaxText.data.tokenizer import HuggingFaceTokenizer
from MaxText.errors import ConfigError, DataError
from MaxText.tests import helpers
from MaxText.tests.conftest import BASE

Image = pytest.importorskip("PIL.Image")
tiny = helpers.end_to_end_script("make_tiny_vision_model")


def png_header(width, height):
  """A PNG holding only its signature, an IHDR of width x height and IEND: what Pillow reads to know the size."""

  def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

  ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
  return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def encoded(fmt, shape=(37, 53)):
  out = io.BytesIO()
  Image.fromarray(np.random.default_rng(0).integers(0, 256, (*shape, 3), dtype=np.uint8)).save(out, fmt)
  return out.getvalue()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("tok"))
  tiny.write_tokenizer(directory, ["What colour is this?", "It is red."] * 8)
  return HuggingFaceTokenizer(directory)


def config_of(limit=89478485):
  c = types.SimpleNamespace(decoder_block="gemma3", image_size_for_vit=16, mm_tokens_per_image=4)
  c.image_start_token_id, c.image_end_token_id, c.image_token_id = tiny.BOI, tiny.EOI, tiny.IMAGE
  c.use_multimodal, c.images_per_row, c.image_tiles_per_row, c.max_image_pixels = True, 1, 0, limit
  c.sft_messages_column, c.sft_prompt_column, c.sft_completion_column = "messages", "prompt", "completion"
  c.sft_train_on_completion_only, c.max_target_length, c.sft_images_column = True, 64, "images"
  return c


def encode(tok, c, image):
  good = os.path.join(os.path.dirname(image), "good.png")
  messages = [{"role": "user", "content": "<start_of_image>What colour is this?"}]
  messages.append({"role": "assistant", "content": "It is red."})
  rows = [(f"chat.jsonl:{i + 1}", {"messages": messages, "images": [path]}) for i, path in enumerate([good, image])]
  return sft.encode(c, tok, chat.load_template(tok), iter(rows), "chat.jsonl")


@pytest.mark.parametrize(
  "content, said",
  [
    (None, r"cannot be read: FileNotFoundError"),
    (b"not an image at all", r"is not a readable image: UnidentifiedImageError"),
    (encoded("PNG")[:-40], r"is not a readable image"),  # truncated: its last chunks are missing
    (encoded("JPEG")[:-200], r"is not a readable image: OSError: image file is truncated"),
    (png_header(12000, 12000), r"has 12000x12000 pixels, more than max_image_pixels=89478485$"),  # 144 MP
  ],
)
def test_a_bad_image_is_one_line_naming_the_row_and_file(tmp_path, tok, content, said):
  (tmp_path / "good.png").write_bytes(encoded("PNG"))
  bad = tmp_path / "bad.img"
  if content is not None:
    bad.write_bytes(content)
  with pytest.raises(DataError, match=rf"^image '{bad}' \(chat.jsonl:2\) {said}") as e:
    encode(tok, config_of(), str(bad))
  assert "\n" not in str(e.value)


def test_the_limit_is_a_key_and_good_images_pass(tmp_path, tok):
  (tmp_path / "good.png").write_bytes(encoded("PNG"))
  (tmp_path / "bad.jpg").write_bytes(encoded("JPEG", (40, 30)))
  assert len(encode(tok, config_of(), str(tmp_path / "bad.jpg")).offsets) == 3  # a good JPEG passes: two rows
  with pytest.raises(DataError, match=r"\(chat.jsonl:1\) has 53x37 pixels, more than max_image_pixels=1000$"):
    encode(tok, config_of(limit=1000), str(tmp_path / "bad.jpg"))
  with pytest.raises(DataError, match=r"^image <8 bytes> \(row 3\) is not a readable image"):
    images.check(b"garbage!", 100, "row 3", "<8 bytes>")
  with pytest.raises(ConfigError, match=r"^max_image_pixels=0 must be >= 1"):
    config.load([BASE, "run_name=t", "max_image_pixels=0"], {})


def test_in_memory_images_of_a_row_are_checked_too(tok):
  c = config_of()
  record = {"bytes": png_header(10000, 10000), "path": "huge.png"}
  messages = [{"role": "user", "content": "What colour is this?"}, {"role": "assistant", "content": "It is red."}]
  rows = iter([("hf row 0", {"messages": messages, "images": [record]})])
  with pytest.raises(DataError, match=r"^image 'huge.png' \(hf row 0\) has 10000x10000 pixels, more than"):
    sft.encode(c, tok, chat.load_template(tok), rows, "rows")
  assert json.dumps(c.max_image_pixels) == "89478485"
