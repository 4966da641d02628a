"""Images for vision-language models (use_multimodal): decoding, resizing, scaling, and the placeholder
tokens that stand for an image in the text (shared by every model with a vision tower).

An image becomes float32 pixels [S, S, C] in [-1, 1] (S = image_size_for_vit; bilinear resize of the RGB image,
then x / 127.5 - 1, Gemma 3's processor: rescale by 1/255, normalise with mean 0.5, std 0.5). In the tokens
it is one block: image_start_token_id, mm_tokens_per_image copies of image_token_id, image_end_token_id.
Paths may be gs:// (read through MaxText/paths.py).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from MaxText import paths
from MaxText.errors import DataError


def _pil():
  from PIL import Image  # noqa: PLC0415 (optional dependency: only use_multimodal runs need Pillow)

  return Image


def to_pixels(image: Any, size: int) -> np.ndarray:
  """A PIL image or an array [H, W, C] (uint8 0-255, or float already in [-1, 1] at the right size) ->
  float32 [size, size, 3] in [-1, 1]."""
  image_cls = _pil()
  if isinstance(image, np.ndarray) and image.dtype != np.uint8:
    if image.shape != (size, size, 3):
      raise DataError(f"a float image must be [{size}, {size}, 3] in [-1, 1], got shape {image.shape}")
    return image.astype(np.float32)
  if isinstance(image, np.ndarray):
    image = image_cls.fromarray(image)
  rgb = image.convert("RGB").resize((size, size), image_cls.Resampling.BILINEAR)
  return np.asarray(rgb, np.float32) / 127.5 - 1.0


def load(path: str, size: int, where: str = "") -> np.ndarray:
  """The image file at `path` (local or gs://) -> float32 [size, size, 3] in [-1, 1]. A missing or
  undecodable file is a DataError naming the file and `where` (e.g. the data row)."""
  at = f" ({where})" if where else ""
  try:
    data = paths.Path(path).read_bytes()
  except (OSError, ValueError) as e:
    raise DataError(f"image {path!r}{at} cannot be read: {type(e).__name__}: {e}") from None
  try:
    with _pil().open(io.BytesIO(data)) as image:
      return to_pixels(image, size)
  except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError... for damaged files
    raise DataError(f"image {path!r}{at} is not a readable image: {type(e).__name__}: {e}") from None


def pixels(image: Any, size: int, where: str = "") -> np.ndarray:
  """A path (str) or an image (PIL, array) -> float32 [size, size, 3] in [-1, 1]."""
  return load(image, size, where) if isinstance(image, str) else to_pixels(image, size)


def block(config: Any) -> list[int]:
  """The tokens of one image: start, mm_tokens_per_image placeholders, end."""
  return [config.image_start_token_id, *[config.image_token_id] * config.mm_tokens_per_image, config.image_end_token_id]


def expand(ids: Sequence[int], n_images: int, config: Any, where: str = "", bos: int = -1) -> list[int]:
  """Prompt or example token ids with `n_images` images -> ids holding one image block per image: each
  image_start_token_id already in the text becomes a whole block (Gemma 3's chat template writes
  <start_of_image> where an image goes); without any, the blocks go first (after a leading `bos`).
  More images than image_start_token_id markers (or fewer) is a DataError naming `where`."""
  return expand_with_mask(ids, [0] * len(ids), n_images, config, where, bos)[0]


def expand_with_mask(
  ids: Sequence[int], mask: Sequence[int], n_images: int, config: Any, where: str = "", bos: int = -1
) -> tuple[list[int], list[int]]:  # fmt: skip
  """expand() of ids and their loss mask together: image tokens never carry loss."""
  ids, mask = list(ids), list(mask)
  at = f" ({where})" if where else ""
  if n_images and not getattr(config, "use_multimodal", False):
    raise DataError(f"{n_images} image(s){at} for a text-only model: set use_multimodal=true with a vision model")
  if not n_images:
    return ids, mask
  if config.image_token_id in ids:
    raise DataError(f"the text{at} holds the image placeholder token {config.image_token_id} itself")
  one = block(config)
  markers = ids.count(config.image_start_token_id)
  if markers == 0:
    first = 1 if bos >= 0 and ids[:1] == [bos] else 0
    return ids[:first] + one * n_images + ids[first:], mask[:first] + [0] * (len(one) * n_images) + mask[first:]
  if markers != n_images:
    raise DataError(f"{n_images} image(s) but {markers} image markers (token {config.image_start_token_id}){at}")
  out_ids, out_mask = [], []
  for token, m in zip(ids, mask):
    is_marker = token == config.image_start_token_id
    out_ids += one if is_marker else [token]
    out_mask += [0] * len(one) if is_marker else [m]
  return out_ids, out_mask
