"""Dense projections with logical axis names on their kernels."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import qwix
from flax import nnx


def _tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return (x,) if isinstance(x, int) else tuple(x)


def weight(param: nnx.Param, dtype: jnp.dtype) -> jax.Array:
  """A matmul weight in `dtype`: a float param cast, or an int8 one (quantization=int8w, a qwix QArray of
  int8 values and per-channel scales, MaxText/inference/quantize.py) dequantized here, next to its use,
  so that memory holds the int8 values and XLA can fuse the scaling into the consumer."""
  value = param.get_value()
  if isinstance(value, qwix.QArray):
    return qwix.dequantize(value).astype(dtype)
  return value.astype(dtype)


class DenseGeneral(nnx.Module):
  """y = x @ W over the last len(in_features) dims of x; W has shape in_features + out_features.

  `kernel_axes` names every kernel dim logically (e.g. ("embed", "mlp")); the kernel is stored in
  `weight_dtype` and cast to `dtype` for the matmul.
  """

  def __init__(
    self,
    in_features: int | Sequence[int],
    out_features: int | Sequence[int],
    kernel_axes: Sequence[str | None],
    *,
    dtype: jnp.dtype,
    weight_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    use_bias: bool = False,
  ):
    self.in_features, self.out_features = _tuple(in_features), _tuple(out_features)
    shape = self.in_features + self.out_features
    n_in = len(self.in_features)
    # Fan-in scaling over all contracted dims, so a [D, N, H] kernel is scaled like a [D, N*H] one.
    init = nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, len(shape)))
    )
    self.kernel = nnx.Param(init(rngs.params(), shape, weight_dtype), out_sharding=tuple(kernel_axes))
    self.bias = nnx.data(None)
    if use_bias:
      bias_axes = tuple(kernel_axes[n_in:])
      self.bias = nnx.Param(jnp.zeros(self.out_features, weight_dtype), out_sharding=bias_axes)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    n_in = len(self.in_features)
    if x.shape[x.ndim - n_in :] != self.in_features:
      raise ValueError(f"DenseGeneral expects trailing dims {self.in_features}, got input shape {x.shape}")
    kernel = weight(self.kernel, self.dtype)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    # The cast matters only under LoRA: Qwix adds its adapters' term in their (parameter) dtype, which
    # would otherwise promote a bfloat16 activation to float32 (layers/lora.py).
    y = jax.lax.dot_general(x.astype(self.dtype), kernel, (contract, ((), ()))).astype(self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y
