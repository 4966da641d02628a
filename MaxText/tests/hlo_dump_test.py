"""dump_hlo (hlo_dump.py): MaxText's debugging keys leave XLA's dump of the compiled step in the run directory,
from train.py and from train_compile.py on the CPU (for a TPU topology through libtpu: train_compile_test.py,
which compiles that program once for this and its saved-step test); bad values fail at load with the key."""

import pytest

from MaxText import config, hlo_dump, train, train_compile
from MaxText.errors import ConfigError
from MaxText.tests.conftest import BASE, TINY, cfg


def dumped(directory, pattern="*jit_train_step*after_optimizations.txt") -> list:
  return sorted(directory.glob(pattern)) if directory.is_dir() else []


@pytest.mark.usefixtures("no_compile_cache")  # XLA dumps only what it compiles
def test_train_run_leaves_the_optimized_hlo_in_its_run_directory(tmp_path, capsys):
  c = cfg(tmp_path, "dump", "steps=1", "dump_hlo=true")
  train.run(c)
  (optimized,) = dumped(tmp_path / "dump" / "hlo")
  assert optimized.read_text().startswith("HloModule jit_train_step")
  assert dumped(tmp_path / "dump" / "hlo", "*jit_train_step*before_optimizations.txt")
  assert not dumped(tmp_path / "dump" / "hlo", "*jit_eval_step*")  # dump_hlo_module_name filters
  assert f"dump_hlo: the compiled step's HLO is in {tmp_path / 'dump' / 'hlo'}" in capsys.readouterr().out


@pytest.mark.usefixtures("no_compile_cache")
def test_train_compile_on_cpu_copies_a_dump_written_elsewhere(tmp_path, capsys):
  argv = ["train_compile.py", BASE, *TINY, f"base_output_directory={tmp_path}", "run_name=aot"]
  argv += ["compile_topology=cpu", "dump_hlo=true", f"dump_hlo_local_dir={tmp_path / 'xla'}"]
  train_compile.main(argv)
  assert dumped(tmp_path / "xla") and dumped(tmp_path / "aot" / "hlo")
  assert [p.name for p in dumped(tmp_path / "xla")] == [p.name for p in dumped(tmp_path / "aot" / "hlo")]


def test_module_name_and_extra_flags_reach_the_compile_options(tmp_path):
  c = cfg(tmp_path, "t", "dump_hlo=true", "dump_hlo_module_name=jit_eval_step")
  c = c.replace(dump_hlo_xla_flags="--xla_dump_hlo_as_proto --xla_dump_max_hlo_modules=3 --xla_dump_to=/tmp/d")
  assert hlo_dump.compiler_options(c) == {
    "xla_dump_to": "/tmp/d", "xla_dump_hlo_as_text": True, "xla_dump_large_constants": True,
    "xla_dump_hlo_module_re": "jit_eval_step", "xla_dump_hlo_as_proto": True, "xla_dump_max_hlo_modules": 3,
  }  # fmt: skip
  assert hlo_dump.compiler_options(c.replace(dump_hlo=False)) == {}
  assert "xla_dump_hlo_module_re" not in hlo_dump.compiler_options(c.replace(dump_hlo_module_name=""))


def test_remote_run_directory_dumps_locally_and_keeps_it_in_the_run_directory(tmp_path):
  c = cfg(tmp_path, "t", "dump_hlo=true").replace(base_output_directory="gs://bucket/runs")
  assert not hlo_dump.local_dir(c).startswith("gs://")
  assert hlo_dump.target_dir(c) == "gs://bucket/runs/t/hlo"
  assert hlo_dump.target_dir(c.replace(dump_hlo_gcs_dir="gs://other/hlo")) == "gs://other/hlo"


@pytest.mark.parametrize(
  "override,match",
  [
    ("dump_hlo_xla_flags=xla_dump_to=/tmp", "dump_hlo_xla_flags: 'xla_dump_to=/tmp' is not an XLA flag"),
    ("dump_hlo_xla_flags=--dump_to=/tmp", "is not an XLA flag"),
    ("dump_hlo_local_dir=gs://b/hlo", "dump_hlo_local_dir: 'gs://b/hlo' is not a local directory; XLA writes its dump"),
    ("dump_hlo_xla_flags=--xla_dump_to=gs://b/hlo", "set dump_hlo_gcs_dir='gs://b/hlo'"),
    ("dump_hlo_module_name=jit_(train", "dump_hlo_module_name='jit_\\(train' is not a regular expression"),
  ],
)
def test_bad_dump_values_fail_at_load_naming_the_key(tmp_path, override, match):
  with pytest.raises(ConfigError, match=match):
    config.load([BASE, "run_name=t", f"base_output_directory={tmp_path}", "dump_hlo=true", override], {})
