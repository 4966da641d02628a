"""Peak FLOP/s table lookup and the measured CPU peak."""

import datetime
import json
import os
import socket
import time
import types

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
  host, _ = accelerators._host_peak_flops("cpu", "float32")
  assert first == pytest.approx(host / len(jax.local_devices(backend="cpu")))


def test_measured_peak_is_kept_per_host_for_a_week(tmp_path, monkeypatch):
  """One process measures; the next on this host reads the cache (MAXTEXT_CACHE_DIR) and says when it was measured.
  A stale or malformed entry, or another host, is measured again; an unwritable cache or =off only measures."""
  measured = []
  monkeypatch.setattr(accelerators, "_measured_peak_flops", lambda *key: measured.append(key) or 1e12 * len(measured))
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(tmp_path))
  host_peak = accelerators._host_peak_flops.__wrapped__  # as a new process: no in-process cache
  assert host_peak("cpu", "float32") == (1e12, "") and len(measured) == 1
  today = datetime.date.today().isoformat()
  assert host_peak("cpu", "float32") == (1e12, today) and len(measured) == 1  # read, not measured
  assert host_peak("cpu", "bfloat16") == (2e12, "") and len(measured) == 2  # another dtype, another entry
  cache = tmp_path / accelerators.PEAK_CACHE_FILE
  entries = json.loads(cache.read_text())
  assert len(entries) == 2 and all(socket.gethostname() in key and "jax " in key for key in entries)

  key = accelerators._host_key("cpu", "float32")
  week_ago = (datetime.date.today() - datetime.timedelta(days=accelerators.PEAK_CACHE_DAYS)).isoformat()
  cache.write_text(json.dumps({**entries, key: {"flops": 5e12, "date": week_ago}}))
  assert host_peak("cpu", "float32") == (3e12, "")  # stale: measured again, and replaced
  assert json.loads(cache.read_text())[key] == {"flops": 3e12, "date": today}
  cache.write_text("{not json")
  assert host_peak("cpu", "float32") == (4e12, "") and len(json.loads(cache.read_text())) == 1
  monkeypatch.setattr(accelerators.socket, "gethostname", lambda: "another-host")
  assert host_peak("cpu", "float32") == (5e12, "") and len(json.loads(cache.read_text())) == 2

  monkeypatch.setenv("MAXTEXT_CACHE_DIR", str(cache / "not-a-directory"))
  assert host_peak("cpu", "float32") == (6e12, "")  # cannot write: measured, no error
  monkeypatch.setenv("MAXTEXT_CACHE_DIR", "off")
  assert host_peak("cpu", "float32") == (7e12, "") and host_peak("cpu", "float32") == (8e12, "")
  assert sorted(os.listdir(tmp_path)) == [accelerators.PEAK_CACHE_FILE]  # no temporary file left behind


def test_cpu_peak_matches_the_run_dtype_within_the_time_budget():
  cpu = jax.devices("cpu")[0]
  start = time.perf_counter()
  bf16 = accelerators.peak(cpu, "bfloat16")
  elapsed = time.perf_counter() - start
  # MAX_TIMED_S of runs, plus one warm-up run and the compilation (generous: the CI host is shared)
  assert elapsed < accelerators.MAX_TIMED_S + 2.0
  assert bf16.flops > 0 and "bfloat16" in bf16.source and "1/8 of the host" in bf16.source
  assert accelerators.peak_flops_per_device(cpu, "bfloat16") == bf16.flops  # cached per dtype
  assert accelerators.peak(cpu).source.startswith("measured float32")  # CPU default: float32
  assert bf16.describe().startswith("peak ") and "TFLOP/s/device (measured bfloat16 matmul, cpu" in bf16.describe()


def test_peak_takes_the_best_of_several_runs(monkeypatch):
  """A run slowed down by another process must not lower the peak: the fastest run counts."""
  elapsed = iter([0.0, 0.5, 10.0, 10.2, 20.0, 20.25, 30.0, 30.5, 40.0, 40.5] + [50.0, 50.5] * 20)
  monkeypatch.setattr(accelerators.time, "perf_counter", lambda: next(elapsed))
  monkeypatch.setattr(accelerators, "MIN_TIMED_S", 1.0)
  monkeypatch.setattr(accelerators, "MAX_TIMED_S", 2.0)
  flops = accelerators._measured_peak_flops.__wrapped__("cpu", "float32")
  # runs of 0.5, 0.2, 0.25, 0.5, 0.5 s: MIN_TIMED_S is passed after 4 runs, but MIN_RUNS is 5
  assert flops == pytest.approx(2 * 2048**3 / 0.2)


def test_table_peak_ignores_dtype():
  tpu = types.SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")
  assert accelerators.peak(tpu, "float32") == accelerators.Peak(197e12, "TPU v5e table, bf16")
  assert accelerators.peak_flops_per_device(tpu) == 197e12
