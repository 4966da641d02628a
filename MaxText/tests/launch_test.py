"""The shared start-up path: every entry point's --help, one wording for config errors, logging set
up once."""

import logging
import os
import subprocess
import sys

import pytest

from MaxText import launch
from MaxText.tests.conftest import BASE, ROOT

USAGE = launch.Usage("python3 tool.py CONFIG.yml", "A tool.", keys=("run_name", "steps"), options=(("rows", "n"),))


@pytest.mark.parametrize(
  "command",
  [
    ["MaxText/train.py"],
    ["MaxText/decode.py"],
    ["MaxText/train_compile.py"],
    ["-m", "MaxText.check_logits"],
    ["-m", "MaxText.data.inspect"],
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


def test_config_errors_exit_with_one_wording():
  with pytest.raises(SystemExit, match=r"^Config error: .*stpes"):
    launch.start([BASE, "stpes=3"], USAGE)
  with pytest.raises(SystemExit, match=r"^Config error: bad$"):
    with launch.user_errors():
      raise launch.ConfigError("bad")


def test_start_loads_the_config_and_logs_once():
  for _ in range(2):
    config = launch.start([BASE, "run_name=x", "steps=3"], USAGE)
  assert config.steps == 3
  handlers = [h for h in logging.getLogger("MaxText").handlers if h.get_name() == launch.LOG_HANDLER]
  assert len(handlers) == 1
