"""Antialiased bilinear resizing of uint8 images, equal to what transformers' image processors get by default.

transformers picks the torchvision backend of an image processor when torchvision is installed (Gemma 3's,
Llama 4's: Llama 4 has no other). Its resize of a uint8 image on a CPU with AVX2/AVX-512 (or an ARM CPU) runs
torch's native uint8 kernel: separable (width first, then height), a triangle filter widened by the scale when
shrinking, float64 weights normalised per output pixel, then rounded to int16 fixed point with as many fraction
bits as keep the largest weight below 2^15, each pass rounding half up and clamping to 0..255. Pillow computes
the same weights with 22 fraction bits, so it differs from the processors by one level of 255 on some pixels;
this module reproduces torch's arithmetic exactly (tests/image_processors_test.py compares them).
"""

from __future__ import annotations

import math

import numpy as np


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(first input index [out], int weights [out, taps], fraction bits) of one axis."""
  scale = in_size / out_size
  support = max(scale, 1.0)  # the triangle's half width in input pixels
  taps = int(math.ceil(support)) * 2 + 1
  centers = scale * (np.arange(out_size) + 0.5)
  first = np.maximum((centers - support + 0.5).astype(np.int64), 0)
  last = np.minimum((centers + support + 0.5).astype(np.int64), in_size)
  count = np.clip(last - first, 0, taps)
  k = np.arange(taps)
  x = (first[:, None] + k[None] - centers[:, None] + 0.5) * (1.0 / scale if scale >= 1 else 1.0)
  w = np.where(k[None] < count[:, None], np.maximum(0.0, 1.0 - np.abs(x)), 0.0)
  total = w.sum(1, keepdims=True)
  w = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
  bits = 0
  while bits < 22 and int(0.5 + w.max() * (1 << (bits + 1))) < (1 << 15):
    bits += 1
  fixed = w * (1 << bits)
  return first, np.trunc(fixed + np.where(fixed < 0, -0.5, 0.5)).astype(np.int64), bits


def _axis(image: np.ndarray, out_size: int, axis: int) -> np.ndarray:
  src = np.moveaxis(image, axis, 0)
  first, weights, bits = _weights(src.shape[0], out_size)
  acc = np.full((out_size, *src.shape[1:]), 1 << (bits - 1), np.int32)  # sums stay below 2^31
  shape = (-1,) + (1,) * (src.ndim - 1)
  for k in range(weights.shape[1]):
    acc += src[np.minimum(first + k, src.shape[0] - 1)] * weights[:, k].reshape(shape).astype(np.int32)
  return np.moveaxis(np.clip(acc >> bits, 0, 255).astype(np.uint8), 0, axis)


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """uint8 [H, W, C] -> uint8 [height, width, C], antialiased bilinear (see the module docstring)."""
  if image.dtype != np.uint8 or image.ndim != 3:
    raise ValueError(f"resize takes a uint8 [H, W, C] image, got {image.dtype} {image.shape}")
  if image.shape[1] != width:
    image = _axis(image, width, 1)
  if image.shape[0] != height:
    image = _axis(image, height, 0)
  return image
