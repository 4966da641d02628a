"""The images of a use_sft record (use_multimodal): what its `sft_images_column` holds, and its pixels.

A record's image column holds one image or a list of them, each either
  - a path (local or gs://, relative ones to the working directory): jsonl/parquet rows, a string column;
  - an in-memory image: a {"bytes": encoded file, "path": name} dict (what `datasets`' Image feature stores,
    so also the rows of a Parquet file that `datasets` wrote, read by dataset_type=text), or a PIL image;
  - an `HfImage`: an image of a Hugging Face dataset's Image column (dataset_type=hf), read from the memory-mapped
    Arrow table when its batch is built, so only the images of the batch are in host memory.
Each is decoded when its batch is built (data/images.py resizes and scales it); any other value, or an image that
cannot be decoded, is a one-line DataError naming the row.
"""

from __future__ import annotations

import io
from typing import Any, NamedTuple

import numpy as np

from MaxText.data import images as images_lib
from MaxText.errors import DataError


class HfImage(NamedTuple):
  """Image `k` of row `row` of a Hugging Face dataset's image column (an Image or a list of Image feature)."""

  column: Any  # the dataset's image column alone, in Arrow format: rows of {bytes, path} structs (or lists of them)
  row: int
  k: int | None  # the position in the row's list; None: the column holds one image per row

  def value(self) -> dict[str, Any]:
    """The {"bytes", "path"} dict of this image (its bytes read now)."""
    cell = self.column[self.row].column(0)[0].as_py()
    return cell if self.k is None else cell[self.k]


def _is_image_struct(arrow_type: Any) -> bool:
  import pyarrow as pa  # noqa: PLC0415 (with datasets, only dataset_type=hf runs need it)

  return pa.types.is_struct(arrow_type) and {"bytes", "path"} <= {f.name for f in arrow_type}


def split_hf_images(dataset: Any, column: str) -> tuple[Any, list[list[HfImage]] | None]:
  """(the dataset without its image column, per row its HfImages) when `column` holds images (datasets' Image
  feature, one per row or a list); (dataset, None) when it holds something else (paths) or is absent. The
  counts come from the Arrow list lengths: no image is read or decoded here."""
  if column not in (dataset.column_names or []):
    return dataset, None
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.compute as pc  # noqa: PLC0415

  arrow = dataset.select_columns([column]).with_format("arrow")
  kind = arrow.features.arrow_schema.field(column).type
  is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
  if not (_is_image_struct(kind) or (is_list and _is_image_struct(kind.value_type))):
    return dataset, None
  refs: list[list[HfImage]] = []
  for batch in arrow.iter(batch_size=4096):  # [rows] Arrow chunks: lengths only, the bytes stay on disk
    cells = batch.column(0)
    if is_list:
      counts = pc.fill_null(pc.list_value_length(cells), 0).to_numpy(zero_copy_only=False)
      refs += [[HfImage(arrow, len(refs) + i, k) for k in range(n)] for i, n in enumerate(counts)]
    else:
      valid = pc.is_valid(cells).to_numpy(zero_copy_only=False)
      refs += [[HfImage(arrow, len(refs) + i, None)] if ok else [] for i, ok in enumerate(valid)]
  return dataset.remove_columns([column]), refs


def _is_image(value: Any) -> bool:
  if isinstance(value, str):
    return bool(value)
  if isinstance(value, dict):
    return bool(value.get("bytes") or value.get("path"))
  return isinstance(value, HfImage) or hasattr(value, "convert")  # a PIL image


def row_images(record: Any, column: str, where: str) -> list[Any]:
  """A record's images (see the module docstring): [] when the column is absent or empty."""
  value = record.get(column) if isinstance(record, dict) else None
  if value is None:
    return []
  if not isinstance(value, (list, tuple)):
    value = [value]
  bad = [v for v in value if not _is_image(v)]
  if bad:
    shown = repr(bad[0]) if len(repr(bad[0])) <= 80 else f"a {type(bad[0]).__name__}"
    raise DataError(
      f"{where}: {column!r} must hold an image path, an image ({{'bytes', 'path'}} or PIL) or a list of them, "
      f"got {shown}"
    )
  return list(value)


def _decoded(data: bytes, name: str, where: str) -> Any:
  from PIL import Image  # noqa: PLC0415 (optional dependency: only use_multimodal runs need Pillow)

  try:
    image = Image.open(io.BytesIO(data))
    image.load()  # Pillow reads lazily: a truncated file fails here, not later in the batch
    return image
  except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError... for damaged data
    raise DataError(f"image {name} ({where}) is not a readable image: {type(e).__name__}: {e}") from None


def resolved(image: Any, where: str) -> Any:
  """One image of `row_images` as data/images.py takes it: a path (str) or a decoded PIL image."""
  if isinstance(image, HfImage):
    image = image.value()
    if not image or not (image.get("bytes") or image.get("path")):
      raise DataError(f"{where}: one of its images is null (no bytes, no path)")
  if isinstance(image, dict):
    if not image.get("bytes"):  # datasets stores a local file by its path alone
      return image["path"]
    name = repr(image["path"]) if image.get("path") else f"<{len(image['bytes'])} bytes>"
    return _decoded(image["bytes"], name, where)
  return image


def check(image: Any, limit: int, where: str) -> None:
  """One image of `row_images` checked cheaply before the run compiles (images.check): it can be read and
  opened, its data is whole, it has at most `limit` pixels. An HfImage's bytes are read from the Arrow table."""
  if isinstance(image, HfImage):
    image = image.value()
    if not image or not (image.get("bytes") or image.get("path")):
      raise DataError(f"{where}: one of its images is null (no bytes, no path)")
  if isinstance(image, dict):
    if not image.get("bytes"):
      return images_lib.check(image["path"], limit, where)
    name = repr(image["path"]) if image.get("path") else f"<{len(image['bytes'])} bytes>"
    return images_lib.check(image["bytes"], limit, where, name)
  images_lib.check(image, limit, where)


def pixels(image: Any, size: int, where: str) -> np.ndarray:
  """One image of `row_images` -> float32 [size, size, 3] in [-1, 1] (images.pixels: resized, scaled)."""
  return images_lib.pixels(resolved(image, where), size, where)
