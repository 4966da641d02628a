"""FP8 block-scaled Hugging Face checkpoints (DeepSeek V3 style), dequantized to float on import.

Such a checkpoint's config.json has quantization_config {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [M, N]}; each quantized weight W [out, in] is stored in float8_e4m3fn next to
`<name>_scale_inv` float32 [ceil(out / M), ceil(in / N)], and the float weight is W * scale_inv of its
M x N block (the last blocks of a dim may be partial). numpy's safetensors reader has no float8 type,
so FP8 tensors are read from the file's header and bytes directly (ml_dtypes gives numpy the type).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from MaxText.errors import ConfigError

SCALE_SUFFIX = "_scale_inv"
FP8_FMTS = ("e4m3", "float8_e4m3fn")  # DeepSeek V3's name and MiniMax M2's for the same format
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def block_size(hf: dict[str, Any]) -> tuple[int, int] | None:
  """The [M, N] weight block of an FP8 block-scaled config.json; None when it has no quantization_config.
  None for gpt-oss's MXFP4 experts too (convert/mxfp4.py). ConfigError for any other quantization (GPTQ, AWQ,
  bitsandbytes, per-tensor FP8, ...)."""
  qc = hf.get("quantization_config")
  if not qc or (isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"):  # MXFP4: convert/mxfp4.py
    return None
  block = qc.get("weight_block_size") if isinstance(qc, dict) else None
  fp8 = isinstance(qc, dict) and qc.get("quant_method") == "fp8" and qc.get("fmt", "e4m3") in FP8_FMTS
  if not fp8 or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
    raise ConfigError(
      f"config.json quantization_config {qc!r} is not supported: only FP8 block-scaled checkpoints "
      '(quant_method "fp8", fmt "e4m3", weight_block_size [M, N]) are dequantized on import; dequantize first'
    )
  return block[0], block[1]


def _header(file: str) -> tuple[dict[str, Any], int]:
  """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts.

  Every tensor of an import is read through here, a shard's header (up to MBs of JSON) once per tensor
  unless cached; the cache key includes size and mtime, so a rewritten file is read again."""
  stat = os.stat(file)
  return _parsed_header(file, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _parsed_header(file: str, size: int, mtime_ns: int) -> tuple[dict[str, Any], int]:
  del size, mtime_ns  # only part of the cache key
  with open(file, "rb") as f:
    (length,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(length)), 8 + length


def read(file: str, name: str) -> np.ndarray:
  """One tensor of a safetensors file as numpy; FP8 tensors as ml_dtypes float8 arrays."""
  header, start = _header(file)
  entry = header[name]
  if entry["dtype"] not in FP8_DTYPES:
    from safetensors import safe_open  # noqa: PLC0415 (optional dependency of the converters)

    with safe_open(file, "np") as f:
      return f.get_tensor(name)
  begin, end = entry["data_offsets"]
  with open(file, "rb") as f:
    f.seek(start + begin)
    data = f.read(end - begin)
  return np.frombuffer(data, FP8_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "") -> np.ndarray:
  """weight [out, in] (float8) * scale_inv [ceil(out/M), ceil(in/N)] per M x N block -> float32 [out, in]."""
  out, inner = weight.shape
  expected = (math.ceil(out / block[0]), math.ceil(inner / block[1]))
  if tuple(scale_inv.shape) != expected:
    raise ConfigError(
      f"Tensor {name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; weight {weight.shape} with "
      f"weight_block_size {list(block)} implies {expected}"
    )
  scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
  return weight.astype(np.float32) * scale[:out, :inner]


def read_weight(file: str, name: str, scale: tuple[str, str] | None, block: tuple[int, int] | None) -> np.ndarray:
  """Tensor `name` of `file`, dequantized when `scale` (its scale_inv's file and name) is given; an FP8
  tensor without a scale is an error (its values alone are not the weights)."""
  tensor = read(file, name)
  if scale is None or block is None:
    if tensor.dtype in FP8_DTYPES.values():
      raise ConfigError(f"Tensor {name} is FP8 but {name}{SCALE_SUFFIX} or weight_block_size is missing")
    return tensor
  return dequantize(tensor, read(*scale), block, name)
