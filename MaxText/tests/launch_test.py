"""The shared start-up path: every entry point's --help, one wording for config errors, logging set
up once."""

import importlib
import logging
import os
import re
import subprocess
import sys

import pytest

from MaxText import launch
from MaxText.errors import ConfigError
from MaxText.tests.conftest import BASE, ROOT

USAGE = launch.Usage("python3 tool.py CONFIG.yml", "A tool.", keys=("run_name", "steps"), options=(("rows", "n"),))


@pytest.mark.quick
@pytest.mark.parametrize(
  "command",
  [
    ["MaxText/train.py"],
    ["MaxText/decode.py"],
    ["MaxText/train_compile.py"],
    ["-m", "MaxText.check_logits"],
    ["-m", "MaxText.data.inspect"],
    ["-m", "MaxText.rl"],
  ],
)
def test_every_entry_point_prints_its_usage(command):
  result = subprocess.run(
    [sys.executable, *command, "--help"], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.startswith("usage: python3 ") and "MaxText/configs/base.yml" in result.stdout
  assert "Config keys it reads most" in result.stdout


def test_usage_shows_keys_with_their_base_yml_comments(capsys):
  with pytest.raises(SystemExit) as e:
    launch.start([BASE, "-h"], USAGE)
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: python3 tool.py CONFIG.yml\n")
  assert "name of the run; a restart with the same name resumes" in out  # run_name's comment
  assert "rows" in out and "base.yml" in out


@pytest.mark.quick
def test_config_errors_exit_with_one_wording():
  with pytest.raises(SystemExit, match=r"^Config error: .*stpes"):
    launch.start([BASE, "stpes=3"], USAGE)
  with pytest.raises(SystemExit, match=r"^Config error: bad$"):
    with launch.user_errors():
      raise ConfigError("bad")


def test_start_loads_the_config_and_logs_once():
  for _ in range(2):
    config = launch.start([BASE, "run_name=x", "steps=3"], USAGE)
  assert config.steps == 3
  handlers = [h for h in logging.getLogger("MaxText").handlers if h.get_name() == launch.LOG_HANDLER]
  assert len(handlers) == 1


def test_no_arguments_print_the_usage_not_an_error(capsys):
  with pytest.raises(SystemExit) as e:
    launch.start([], USAGE)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: python3 tool.py CONFIG.yml") and "quickstart" in err and "<entry point>" not in err


@pytest.mark.parametrize(
  "module, prog",
  [
    ("MaxText.convert.hf_to_maxtext", "python3 -m MaxText.convert.hf_to_maxtext"),
    ("MaxText.convert.maxtext_to_hf", "python3 -m MaxText.convert.maxtext_to_hf"),
    ("MaxText.data.convert_to_arrayrecord", "python3 -m MaxText.data.convert_to_arrayrecord"),
    ("MaxText.data.train_tokenizer", "python3 -m MaxText.data.train_tokenizer"),
    ("MaxText.plot_metrics", "python3 -m MaxText.plot_metrics"),
  ],
)
def test_tool_clis_print_usage_with_pointers(capsys, module, prog):
  main = __import__(module, fromlist=["main"]).main
  with pytest.raises(SystemExit) as e:
    main([f"{module}.py", "--help"])
  assert e.value.code == 0
  assert capsys.readouterr().out.startswith(f"usage: {prog}")


@pytest.mark.parametrize(
  "command",
  [
    ["bash", "setup.sh", "--help"],
    ["bash", "unit_test_and_lint.sh", "--help"],
    ["bash", "download_dataset.sh", "--help"],
    ["bash", "end_to_end/cpu/quickstart.sh", "--help"],
    ["bash", "end_to_end/cpu/smoke.sh", "--help"],
    ["bash", "end_to_end/cpu/compare_maxtext.sh", "--help"],
    ["bash", "end_to_end/cpu/post_train.sh", "--help"],
    ["bash", "end_to_end/gpu/launch.sh", "--help"],
    ["bash", "end_to_end/gpu/pipeline.sh", "--help"],
    ["bash", "scripts/multigpu_jaxpp.sh", "--help"],
    [sys.executable, "multihost_runner.py", "--help"],
    [sys.executable, "multihost_job.py", "--help"],
    [sys.executable, "end_to_end/assert_metrics.py", "--help"],
    [sys.executable, "benchmarks/aot_memory.py", "--help"],
  ],
)
def test_scripts_answer_help_without_running(command):
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "python3 " in result.stdout or "bash " in result.stdout, result.stdout


def test_console_scripts_name_callables():
  with open(os.path.join(ROOT, "pyproject.toml")) as f:  # tomllib is Python 3.11+; the entries are one line each
    section = f.read().split("[project.scripts]")[1].split("\n[")[0]
  scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', section, re.M))
  assert set(scripts) >= {"maxtext-train", "maxtext-decode", "maxtext-train-compile"}
  for target in scripts.values():
    module, name = target.split(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_doc_help_prints_the_docstring_for_help_only(capsys):
  launch.doc_help(["steps=3"], "python3 tool.py [key=value ...]")  # not asked: returns
  with pytest.raises(SystemExit) as e:
    launch.doc_help(["--help"], "\npython3 tool.py [key=value ...]\n")
  assert e.value.code == 0 and capsys.readouterr().out == "python3 tool.py [key=value ...]\n"
