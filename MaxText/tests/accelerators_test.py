"""Peak FLOP/s table lookup and the measured CPU peak."""

import time

import jax
import pytest

from MaxText import accelerators


@pytest.mark.parametrize(
  "device_kind, name, peak_tflops",
  [
    ("TPU v2", "TPU v2", 22.5),
    ("TPU v3", "TPU v3", 61.5),
    ("TPU v4", "TPU v4", 275),
    ("TPU v4 lite", "TPU v4 lite", 138),
    ("TPU v5 lite", "TPU v5e", 197),
    ("TPU v5e", "TPU v5e", 197),
    ("TPU v5", "TPU v5p", 459),
    ("TPU v5p", "TPU v5p", 459),
    ("TPU v6 lite", "TPU v6e", 918),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756),
    ("NVIDIA H100 NVL", "H100 NVL", 835),
    ("NVIDIA H200", "H200", 989),
    ("NVIDIA GH200 480GB", "GH200", 989),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB", 312),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312),
    ("NVIDIA A100 80GB PCIe", "A100 80GB", 312),
    ("NVIDIA L4", "L4", 121),
    ("NVIDIA L40S", "L40S", 362),
    ("NVIDIA B200", "B200", 2250),
  ],
)
def test_lookup_by_device_kind(device_kind, name, peak_tflops):
  spec = accelerators.device_spec(device_kind)
  assert spec is not None and spec.name == name
  assert spec.peak_flops == pytest.approx(peak_tflops * 1e12)
  assert accelerators.device_spec(device_kind.upper()) == spec  # case-insensitive


def test_hbm_bytes():
  assert accelerators.device_spec("NVIDIA A100-PCIE-40GB").hbm_bytes == 40 * 2**30
  assert accelerators.device_spec("TPU v5 lite").hbm_bytes == 16 * 2**30
  assert accelerators.hbm_bytes_per_device(jax.devices("cpu")[0]) is None


def test_unknown_kind_has_no_entry():
  assert accelerators.device_spec("cpu") is None
  assert accelerators.device_spec("Some Future Chip") is None


def test_cpu_peak_is_measured_once_and_shared_by_local_devices():
  cpu = jax.devices("cpu")[0]
  first = accelerators.peak_flops_per_device(cpu)
  assert first > 0
  start = time.perf_counter()
  assert accelerators.peak_flops_per_device(cpu) == first
  assert time.perf_counter() - start < 0.01  # cached, not measured again
  host = accelerators._measured_peak_flops("cpu")
  assert first == pytest.approx(host / len(jax.local_devices(backend="cpu")))
