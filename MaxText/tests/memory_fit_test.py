"""Before allocating: a run whose state cannot fit is one line, one that will likely be killed is warned about,
and a slow CPU run says how slow (MaxText/memory_fit.py)."""

import jax
import pytest

from MaxText import memory_fit, optimizers, planner, sharding
from MaxText import state as state_lib
from MaxText.errors import ConfigError
from MaxText.tests.conftest import cfg

GiB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  c = cfg(tmp_path_factory.mktemp("fit"), "fit")
  mesh = sharding.create_mesh(c, jax.devices())
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, optimizers.build(c).tx, mesh, planner.build(c, mesh))
  return c, mesh, spec


def test_the_exact_part_is_the_state_and_its_gradients_on_every_cpu_device(tiny):
  c, mesh, spec = tiny
  n = memory_fit.need(c, mesh, spec.abstract)
  params = memory_fit.per_device_bytes(spec.abstract.params)
  assert n.exact == memory_fit.per_device_bytes(spec.abstract) + params and n.activations > 0
  assert n.devices == 8  # the 8 CPU devices of this process share the host's memory


def test_a_small_run_says_nothing(tiny):
  c, mesh, spec = tiny
  assert memory_fit.check(c, mesh, spec.abstract, 1e6, 1e9) == []


def test_a_state_larger_than_free_memory_is_one_line_before_allocating(tiny, monkeypatch):
  c, mesh, spec = tiny
  n = memory_fit.need(c, mesh, spec.abstract)
  monkeypatch.setattr(memory_fit, "free_bytes", lambda device: n.exact * n.devices // 2)
  with pytest.raises(ConfigError, match=r"GiB is missing before any activation; use a smaller recipe") as e:
    memory_fit.check(c, mesh, spec.abstract, 1e6, 1e9)
  assert "\n" not in str(e.value) and "train_compile.py" in str(e.value)
  assert memory_fit.check(c.replace(check_memory_fit=False), mesh, spec.abstract, 1e6, 1e9) == []


def test_an_estimate_near_free_memory_warns(tiny, monkeypatch):
  c, mesh, spec = tiny
  n = memory_fit.need(c, mesh, spec.abstract)
  monkeypatch.setattr(memory_fit, "free_bytes", lambda device: int(n.total * n.devices * 1.05))
  (line,) = memory_fit.check(c, mesh, spec.abstract, 1e6, 1e9)
  assert line.startswith("warning: this run needs") and "likely be killed for lack of memory" in line


def test_a_slow_cpu_run_says_how_slow(tiny):
  c, mesh, spec = tiny
  (line,) = memory_fit.check(c.replace(steps=10), mesh, spec.abstract, 8 * 100e9, 1e9)  # 100 s per step
  assert line == "note: expect about 200 s per step on this CPU (0.8 TFLOP per step); 10 steps would take about 0.6 h"
