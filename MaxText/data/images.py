"""Images for vision-language models (use_multimodal): decoding, resizing, scaling, and the placeholder
tokens that stand for an image in the text (shared by every model with a vision tower).

Each family has a Scheme (SCHEMES, keyed by decoder_block; the square one for the others):
- square (Gemma 3): an image becomes one tile, float32 pixels [S, S, C] in [-1, 1] (S = image_size_for_vit;
  antialiased bilinear resize of the RGB image, then (x - 127.5) / 127.5, Gemma 3's processor: rescale by 1/255,
  normalise with mean 0.5, std 0.5). In the tokens it is one block: image_start_token_id, mm_tokens_per_image
  copies of image_token_id, image_end_token_id; image_start_token_id marks where an image goes in a prompt, and
  the prompt's text gets "\n\n" before and after it (processor_text), as Gemma3Processor writes it.
- tiled (Llama 4): the image is resized, keeping its aspect ratio, onto the best-fitting canvas of h x w tiles
  (h * w <= max_image_tiles), padded with black on the right and bottom, and cut into h * w tiles of S x S, plus
  a global tile (the whole image squashed to S x S) when h * w > 1; pixels rescaled and normalised as above, in
  bfloat16 as Llama4ImageProcessor does. Its block: image_start_token_id; when h * w > 1, per grid row the
  tiles' placeholders separated by tile_x_separator_token_id and closed by tile_y_separator_token_id; then
  image_global_token_id (<|image|>, also the prompt's marker) and the global (or only) tile's placeholders;
  image_end_token_id. Each tile has (image_size_for_vit / patch_size_for_vit * pixel_shuffle_ratio_for_vit)^2
  placeholders (image_token_id).
Images are made RGB with any transparency composited onto white, as transformers does, and resized as its
processors' default (torchvision) path resizes them on a CPU (data/resize.py: the same uint8 values). Paths may be gs://
(read through MaxText/paths.py).
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from MaxText import paths
from MaxText.data import resize as resize_lib
from MaxText.errors import ConfigError, DataError


def _pil():
  from PIL import Image  # noqa: PLC0415 (optional dependency: only use_multimodal runs need Pillow)

  return Image


def to_pixels(image: Any, size: int) -> np.ndarray:
  """A PIL image or an array [H, W, C] (uint8 0-255, or float already in [-1, 1] at the right size) ->
  float32 [size, size, 3] in [-1, 1]."""
  if isinstance(image, np.ndarray) and image.dtype != np.uint8:
    if image.shape != (size, size, 3):
      raise DataError(f"a float image must be [{size}, {size}, 3] in [-1, 1], got shape {image.shape}")
    return image.astype(np.float32)
  rgb = resize_lib.resize(np.asarray(to_rgb(image)), size, size)
  return (rgb.astype(np.float32) - 127.5) / 127.5  # transformers' fused rescale + normalise


def _read(path: str, where: str) -> bytes:
  try:
    return paths.Path(path).read_bytes()
  except (OSError, ValueError) as e:
    at = f" ({where})" if where else ""
    raise DataError(f"image {path!r}{at} cannot be read: {type(e).__name__}: {e}") from None


def check(image: Any, limit: int, where: str = "", name: str = "") -> None:
  """An image file's path (local or gs://), its bytes (named `name`), or a PIL image/uint8 array: a DataError
  naming it and `where` when it cannot be read or opened, its data is damaged, or it has more than `limit`
  pixels. Cheap, for every image before a run compiles: the header gives the size; a PNG's chunk checksums
  are verified and a JPEG is decoded at 1/8 scale (so a truncated file is caught too); no full decode."""
  at = f" ({where})" if where else ""
  if isinstance(image, str):
    image, name = _read(image, where), repr(image)
  if not isinstance(image, (bytes, bytearray)):
    height, width = image.shape[:2] if isinstance(image, np.ndarray) else (image.height, image.width)
    if height * width > limit:
      raise DataError(f"an image{at} has {width}x{height} pixels, more than max_image_pixels={limit}")
    return
  image_cls = _pil()
  try:
    with warnings.catch_warnings():  # our limit, not Pillow's warning, decides (Pillow raises above twice its own)
      warnings.simplefilter("ignore", image_cls.DecompressionBombWarning)
      with image_cls.open(io.BytesIO(image)) as opened:
        width, height = opened.size
        if width * height > limit:
          raise DataError(f"image {name}{at} has {width}x{height} pixels, more than max_image_pixels={limit}")
        if opened.format == "JPEG":
          opened.draft("RGB", (max(width // 8, 1), max(height // 8, 1)))
          opened.load()
        else:
          opened.verify()
  except DataError:
    raise
  except image_cls.DecompressionBombError as e:
    raise DataError(f"image {name}{at} has more pixels than max_image_pixels={limit}: {e}") from None
  except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError... for damaged files
    raise DataError(f"image {name}{at} is not a readable image: {type(e).__name__}: {e}") from None


def _open(path: str, where: str, use: Callable[[Any], Any]) -> Any:
  """use(the decoded PIL image of the file at `path`); a missing or undecodable file is a DataError."""
  at = f" ({where})" if where else ""
  data = _read(path, where)
  try:
    with _pil().open(io.BytesIO(data)) as image:
      return use(image)
  except DataError:
    raise
  except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError... for damaged files
    raise DataError(f"image {path!r}{at} is not a readable image: {type(e).__name__}: {e}") from None


def to_rgb(image: Any) -> Any:
  """A PIL image or uint8 array [H, W, C] -> an RGB PIL image; transparency composited onto white, as
  transformers' processors convert images."""
  image_cls = _pil()
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8:
      raise DataError(f"an image array must be uint8 [H, W, C] here, got {image.dtype} {image.shape}")
    image = image_cls.fromarray(image)
  if "A" not in image.getbands() and image.info.get("transparency") is None:
    return image.convert("RGB")
  white = image_cls.new("RGBA", image.size, (255, 255, 255, 255))
  return image_cls.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def load(path: str, size: int, where: str = "") -> np.ndarray:
  """The image file at `path` (local or gs://) -> float32 [size, size, 3] in [-1, 1]. A missing or
  undecodable file is a DataError naming the file and `where` (e.g. the data row)."""
  return _open(path, where, lambda image: to_pixels(image, size))


def pixels(image: Any, size: int, where: str = "") -> np.ndarray:
  """A path (str) or an image (PIL, array) -> float32 [size, size, 3] in [-1, 1]."""
  return load(image, size, where) if isinstance(image, str) else to_pixels(image, size)


class Prepared(NamedTuple):
  tiles: np.ndarray  # float32 [n, S, S, 3]: what the vision encoder takes for this image, in order
  tokens: list[int]  # the image's block in the text (its placeholders take the tiles' soft tokens in order)


class Scheme(NamedTuple):
  """How a family turns an image into encoder input and text (see the module docstring)."""

  marker: Callable[[Any], int]  # config -> the prompt token that stands for an image (becomes its block)
  grid: Callable[[Any, tuple[int, int]], tuple[int, int]]  # config, (height, width) -> tile grid (rows, cols)
  tiles: Callable[[Any, Any], np.ndarray]  # RGB PIL image, config -> float32 [n, S, S, 3]
  tokens: Callable[[Any, tuple[int, int]], list[int]]  # config, grid -> the image's block
  around: str = ""  # text the family's processor writes before and after each image's block (Gemma 3: "\n\n")


def num_tiles(grid: tuple[int, int]) -> int:
  """Tiles of an image cut on `grid`: the grid's, plus the global tile when there is more than one."""
  return grid[0] * grid[1] + (grid[0] * grid[1] > 1)


def tile_tokens(config: Any) -> int:
  """Llama 4's soft tokens per tile: the pixel-shuffled patch grid (models/llama4_vision.tokens_per_image)."""
  return round(config.image_size_for_vit // config.patch_size_for_vit * config.pixel_shuffle_ratio_for_vit) ** 2


def canvases(max_tiles: int) -> list[tuple[int, int]]:
  """Tile grids (rows, cols) with rows * cols <= max_tiles, in Llama4ImageProcessor's order (grouped by aspect
  ratio in order of first appearance, counting down from max_tiles; its ties go to the first)."""
  by_ratio: dict[float, list[tuple[int, int]]] = {}
  for n in range(max_tiles, 0, -1):
    for rows in (f for f in range(1, n + 1) if n % f == 0):
      by_ratio.setdefault(rows / (n // rows), []).append((rows, n // rows))
  return [g for grids in by_ratio.values() for g in grids]


def best_grid(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
  """The grid whose canvas (tile pixels per cell) takes the image with the least upscaling (else the least
  downscaling), then the least area; scales in float32 as the processor computes them."""
  if max_tiles < 1:
    raise ConfigError(f"max_image_tiles={max_tiles}: an image needs at least one tile (Llama 4: 16)")
  grids = np.array(canvases(max_tiles), np.int64)
  scale_h = (grids[:, 0] * tile).astype(np.float32) / np.float32(height)
  scale_w = (grids[:, 1] * tile).astype(np.float32) / np.float32(width)
  scales = np.minimum(scale_h, scale_w)
  chosen = scales[scales >= 1].min() if (scales >= 1).any() else scales.max()
  fits = grids[scales == chosen]
  r, c = fits[np.argmin(fits[:, 0] * fits[:, 1])]
  return int(r), int(c)


def fit_size(height: int, width: int, canvas: tuple[int, int], tile: int) -> tuple[int, int]:
  """(height, width) the image is resized to inside `canvas` (pixels) keeping its aspect ratio, never upscaled
  past max(its side, one tile). A canvas side smaller than the image's is a float32 value in the processor (a
  tensor), a larger one a Python int: numpy's scalars give the same roundings."""
  cap = [max(height, tile), max(width, tile)]
  target = [np.int64(t) if t < c else c for t, c in zip(canvas, cap)]

  def scale(t: Any, side: int) -> Any:
    return np.float32(t) / np.float32(side) if isinstance(t, np.int64) else t / side

  scale_h, scale_w = scale(target[0], height), scale(target[1], width)
  if scale_w < scale_h:
    new_h, new_w = min(math.floor(height * scale_w), int(target[0])), int(target[1])
  else:
    new_h, new_w = int(target[0]), min(math.floor(width * scale_h), int(target[1]))
  return max(new_h, 1), max(new_w, 1)


def _normalise_bf16(rgb: np.ndarray) -> np.ndarray:
  """uint8 [..., 3] -> float32 in [-1, 1] through bfloat16 as Llama4ImageProcessor rescales and normalises:
  round(round(x * (1/255)) - 0.5) / 0.5, each rounding to bfloat16."""
  x = (rgb.astype(np.float32) * np.float32(1 / 255)).astype(jnp.bfloat16).astype(np.float32)
  return ((x - np.float32(0.5)).astype(jnp.bfloat16).astype(np.float32) / np.float32(0.5)).astype(np.float32)


def _llama4_tiles(image: Any, config: Any) -> np.ndarray:
  size, rgb = config.image_size_for_vit, np.asarray(image)
  grid = best_grid(image.height, image.width, config.max_image_tiles, size)
  canvas = np.zeros((grid[0] * size, grid[1] * size, 3), np.uint8)  # black padding right and bottom
  new_h, new_w = fit_size(image.height, image.width, (grid[0] * size, grid[1] * size), size)
  canvas[:new_h, :new_w] = resize_lib.resize(rgb, new_h, new_w)
  tiles = canvas.reshape(grid[0], size, grid[1], size, 3).swapaxes(1, 2).reshape(-1, size, size, 3)
  if grid[0] * grid[1] > 1:
    whole = resize_lib.resize(rgb, size, size)
    tiles = np.concatenate([tiles, whole[None]])
  return _normalise_bf16(tiles)


def _llama4_tokens(config: Any, grid: tuple[int, int]) -> list[int]:
  patches = [config.image_token_id] * tile_tokens(config)
  out = [config.image_start_token_id]
  if grid[0] * grid[1] > 1:
    for _ in range(grid[0]):
      for x in range(grid[1]):
        out += patches + ([config.tile_x_separator_token_id] if x < grid[1] - 1 else [])
      out.append(config.tile_y_separator_token_id)
  return out + [config.image_global_token_id, *patches, config.image_end_token_id]


SQUARE = Scheme(
  marker=lambda config: config.image_start_token_id,
  grid=lambda config, hw: (1, 1),
  tiles=lambda image, config: to_pixels(image, config.image_size_for_vit)[None],
  tokens=lambda config, grid: block(config),
  around="\n\n",  # Gemma3Processor: "\n\n" + block + "\n\n"
)
LLAMA4 = Scheme(
  marker=lambda config: config.image_global_token_id,
  grid=lambda config, hw: best_grid(*hw, config.max_image_tiles, config.image_size_for_vit),
  tiles=_llama4_tiles,
  tokens=_llama4_tokens,
)
SCHEMES = {"llama4": LLAMA4}  # decoder_block -> Scheme; every other vision model: SQUARE


def scheme(config: Any) -> Scheme:
  return SCHEMES.get(config.decoder_block, SQUARE)


def slots_per_row(config: Any) -> int:
  """Tile slots of one batch row (the batch's images axis): image_tiles_per_row, else images_per_row."""
  return config.image_tiles_per_row or config.images_per_row


def prepare(image: Any, config: Any, where: str = "") -> Prepared:
  """A path (local or gs://), PIL image or uint8 array [H, W, 3] -> its tiles and its block of tokens."""
  s = scheme(config)
  if s is SQUARE and not isinstance(image, str):  # a float array already in [-1, 1] is accepted here
    return Prepared(to_pixels(image, config.image_size_for_vit)[None], block(config))

  def both(img: Any) -> Prepared:
    rgb = to_rgb(img)
    return Prepared(s.tiles(rgb, config), s.tokens(config, s.grid(config, (rgb.height, rgb.width))))

  return _open(image, where, both) if isinstance(image, str) else both(image)


def layout(image: Any, config: Any, where: str = "") -> tuple[list[int], int]:
  """(block, tiles) of an image file's path (or a PIL image), from its size alone (its pixels are decoded when a
  batch is built): square schemes need no read at all."""
  s = scheme(config)
  if s is SQUARE:
    return block(config), 1
  if isinstance(image, str):
    grid = _open(image, where, lambda im: s.grid(config, (im.height, im.width)))
  else:
    grid = s.grid(config, (image.height, image.width))
  return s.tokens(config, grid), num_tiles(grid)


def processor_text(text: str, images: int, config: Any, tok: Any) -> tuple[str, Callable[[int], int]]:
  """(`text` of a prompt or example with `images` images as the family's processor writes it before tokenizing,
  a map of character positions of `text` to the new text). Each image marker (scheme(config).marker as the
  tokenizer writes it) gets the scheme's `around` text on both sides; a text without a marker gets one per image
  first (after a leading BOS). Tokenized, then expand()-ed, that gives the processor's ids exactly (the special
  tokens split the text the same way). Unchanged when the tokenizer cannot write the marker as its one token."""
  writer = getattr(tok, "token_text", None)
  marker_id = scheme(config).marker(config) if images and getattr(config, "use_multimodal", False) else -1
  marker = writer(marker_id) if writer is not None and marker_id >= 0 else ""
  if not marker or tok.encode(marker) != [marker_id]:
    return text, lambda p: p
  inserts: list[tuple[int, str]] = []  # (position in text, inserted text), in order
  if marker not in text:
    bos = writer(tok.bos_id) if tok.bos_id >= 0 else ""
    first = len(bos) if bos and text.startswith(bos) else 0
    inserts.append((first, marker * images))
    text = text[:first] + marker * images + text[first:]
  around = scheme(config).around
  out, at, moved = [], 0, []  # moved: (position in the text with its markers, characters inserted there)
  k = text.find(marker) if around else -1
  while k >= 0:
    out += [text[at:k], around, marker, around]
    at = k + len(marker)
    moved += [(k, len(around)), (at, len(around))]
    k = text.find(marker, at)

  def move(p: int) -> int:
    p += sum(len(t) for q, t in inserts if q < p)
    return p + sum(n for q, n in moved if q < p)

  return "".join(out) + text[at:], move


def block(config: Any) -> list[int]:
  """The tokens of one image: start, mm_tokens_per_image placeholders, end."""
  return [config.image_start_token_id, *[config.image_token_id] * config.mm_tokens_per_image, config.image_end_token_id]


def expand(
  ids: Sequence[int], images: int | Sequence[list[int]], config: Any, where: str = "", bos: int = -1
) -> list[int]:
  """Prompt or example token ids with images (a count: square blocks; or each image's block, prepare().tokens)
  -> ids holding each image's block: each marker (scheme(config).marker: Gemma 3's <start_of_image>, Llama 4's
  <|image|>, which their chat templates write where an image goes) already in the text becomes the next
  image's block; without any, the blocks go first (after a leading `bos`). More images than markers (or
  fewer) is a DataError naming `where`."""
  return expand_with_mask(ids, [0] * len(ids), images, config, where, bos)[0]


def expand_with_mask(
  ids: Sequence[int], mask: Sequence[int], images: int | Sequence[list[int]], config: Any, where: str = "",
  bos: int = -1,
) -> tuple[list[int], list[int]]:  # fmt: skip
  """expand() of ids and their loss mask together: image tokens never carry loss."""
  ids, mask = list(ids), list(mask)
  blocks = [block(config)] * images if isinstance(images, int) else [list(b) for b in images]
  at = f" ({where})" if where else ""
  if blocks and not getattr(config, "use_multimodal", False):
    raise DataError(f"{len(blocks)} image(s){at} for a text-only model: set use_multimodal=true with a vision model")
  if not blocks:
    return ids, mask
  if config.image_token_id in ids:
    raise DataError(f"the text{at} holds the image placeholder token {config.image_token_id} itself")
  marker = scheme(config).marker(config)
  markers = ids.count(marker)
  if markers == 0:
    first = 1 if bos >= 0 and ids[:1] == [bos] else 0
    flat = [t for b in blocks for t in b]
    return ids[:first] + flat + ids[first:], mask[:first] + [0] * len(flat) + mask[first:]
  if markers != len(blocks):
    raise DataError(f"{len(blocks)} image(s) but {markers} image markers (token {marker}){at}")
  out_ids, out_mask, k = [], [], 0
  for token, m in zip(ids, mask):
    if token == marker:
      out_ids += blocks[k]
      out_mask += [0] * len(blocks[k])
      k += 1
    else:
      out_ids.append(token)
      out_mask.append(m)
  return out_ids, out_mask
