"""MXFP4 expert weights (gpt-oss's released checkpoints), dequantized to float on import.

Such a checkpoint's config.json has quantization_config {"quant_method": "mxfp4"}; each quantized tensor W
(HF layout [E, in, out] after dequantization) is stored as `<name>_blocks` uint8 [E, out, in / 32, 16] and
`<name>_scales` uint8 [E, out, in / 32]: blocks of 32 values along `in`, two FP4 (E2M1) codes per byte (the
low nibble first), and one E8M0 scale per block (the value is code * 2^(scale - 127)). The other tensors
(attention, router, biases, norms, embeddings) are stored unquantized. Export writes plain float tensors.
"""

from __future__ import annotations

import numpy as np

from MaxText.convert import fp8

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # values per scale
# FP4 E2M1: sign bit, 2 exponent bits, 1 mantissa bit -> these 16 values, indexed by the 4-bit code.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def unpack_index(
  index: dict[str, tuple[str, tuple[int, ...]]],
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], set[str]]:
  """A tensor index (name -> (file, shape)) with each `<name>_blocks` / `<name>_scales` pair replaced by
  `<name>` and its dequantized shape [E, in, out]; and the set of those names."""
  out, packed = dict(index), set()
  for name, (file, shape) in index.items():
    base = name[: -len(BLOCKS)]
    if name.endswith(BLOCKS) and base + SCALES in index:
      *lead, rows, groups, _ = shape
      out[base] = (file, (*lead, groups * BLOCK, rows))
      packed.add(base)
      del out[name], out[base + SCALES]
  return out, packed


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32]."""
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
  exponents = scales.astype(np.int32)[..., None] - 127
  return np.ldexp(E2M1[codes], exponents).reshape(*blocks.shape[:-2], -1)


def read(file: str, name: str) -> np.ndarray:
  """Tensor `name` of `file` from its blocks and scales, in the HF float layout [E, in, out]."""
  weights = dequantize(fp8.read(file, name + BLOCKS), fp8.read(file, name + SCALES))  # [E, out, in]
  return np.swapaxes(weights, -1, -2)
