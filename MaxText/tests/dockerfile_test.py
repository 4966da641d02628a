"""The Dockerfile, read without a Docker daemon: its cpu, tpu and gpu targets exist, install the pinned
requirements files (each pin as the files say), copy only what the repository has and run train.py.

With a Docker daemon, MAXTEXT_DOCKER_TEST=1 also builds the cpu image and runs the cpu/smoke recipe in it
(minutes: the requirements are downloaded; MAXTEXT_DOCKER_BASE=<image> replaces python:3.12-slim-bookworm
where Docker Hub is out of reach).
"""

import fnmatch
import json
import os
import re
import shlex
import subprocess
from typing import NamedTuple

import pytest

from MaxText.tests.conftest import ROOT

TARGETS = {"cpu": [], "tpu": ["requirements-tpu.txt"], "gpu": ["requirements-gpu.txt"]}


class Instruction(NamedTuple):
  stage: str  # the stage's name (FROM ... AS name), or its image
  word: str  # FROM, RUN, COPY, ... (upper case)
  rest: str  # the arguments, continuation lines joined


def instructions(path: str = os.path.join(ROOT, "Dockerfile")) -> list[Instruction]:
  """Dockerfile syntax: `#` comment lines, `\\` continues a line, ARGs expand in FROM."""
  with open(path) as f:
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", f.read())
  found, stage, args = [], "", {}
  for line in text.splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    word, _, rest = line.partition(" ")
    word, rest = word.upper(), rest.strip()
    if word == "ARG" and not stage:
      name, _, default = rest.partition("=")
      args[name] = default
    if word == "FROM":
      image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), rest.split()[0])
      stage = rest.split()[2] if len(rest.split()) == 3 and rest.split()[1].upper() == "AS" else image
    found.append(Instruction(stage, word, rest))
  return found


def stages() -> dict[str, str]:
  """stage name -> the stage (or image) it builds on."""
  return {i.stage: i.rest.split()[0] for i in instructions() if i.word == "FROM"}


def chain(target: str) -> list[Instruction]:
  """Every instruction that builds `target`, its base stages' first."""
  parents, name = [], target
  while name in stages():
    parents.insert(0, name)
    name = stages()[name]
  return [i for p in parents for i in instructions() if i.stage == p]


def pins(path: str) -> dict[str, str]:
  """name (with [extras]) -> pinned version, from one requirements file; every line must pin."""
  result = {}
  with open(os.path.join(ROOT, path)) as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      if line:
        name, sep, version = line.partition("==")
        assert sep and version, f"{path}: {line!r} is not pinned with =="
        result[name.strip().lower()] = version.strip()
  return result


def test_every_target_builds_on_the_base_and_runs_train_py():
  assert set(TARGETS) <= set(stages()), f"targets {sorted(stages())}"
  for target in TARGETS:
    steps = chain(target)
    entrypoint = [i for i in steps if i.word == "ENTRYPOINT"][-1]
    assert json.loads(entrypoint.rest) == ["python3", "MaxText/train.py"]
    cmd = json.loads([i for i in steps if i.word == "CMD"][-1].rest)  # train.py's default arguments: a recipe
    assert os.path.exists(os.path.join(ROOT, "MaxText", "configs", cmd[0] + ".yml"))
    assert os.path.exists(os.path.join(ROOT, "MaxText", "train.py"))


def test_each_target_installs_its_requirements_files_after_copying_them():
  for target, extra in TARGETS.items():
    copied, installed = set(), []
    for i in chain(target):
      if i.word == "COPY":
        copied.update(shlex.split(i.rest)[:-1])
      if i.word == "RUN" and "pip install" in i.rest:
        files = re.findall(r"-r (\S+)", i.rest)
        assert files and set(files) <= copied, f"{target}: {i.rest!r} installs what was not copied before"
        installed += files
    assert installed == ["requirements.txt", *extra], target


def test_copy_sources_exist_and_are_not_ignored():
  with open(os.path.join(ROOT, ".dockerignore")) as f:
    ignored = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  assert {".git", ".venv"} <= set(ignored)
  for i in instructions():
    if i.word == "COPY":
      for source in shlex.split(i.rest)[:-1]:
        assert not source.startswith("--"), f"COPY {i.rest}: flags are not checked here"
        assert os.path.exists(os.path.join(ROOT, source)), f"COPY {source}: not in the repository"
        assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), f"{source} is in .dockerignore"


def test_the_pins_agree_across_requirements_files():
  """requirements-gpu.txt's jax[cuda12] is requirements.txt's jax; libtpu is pinned; nothing unpinned."""
  runtime, tpu, gpu = pins("requirements.txt"), pins("requirements-tpu.txt"), pins("requirements-gpu.txt")
  assert gpu == {"jax[cuda12]": runtime["jax"]}
  assert set(tpu) == {"libtpu"}
  assert runtime["jax"] == runtime["jaxlib"]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MAXTEXT_DOCKER_TEST"), reason="MAXTEXT_DOCKER_TEST=1 builds the image")
def test_cpu_image_runs_the_smoke_recipe(tmp_path):
  base = os.environ.get("MAXTEXT_DOCKER_BASE")
  build = ["docker", "build", "--network=host", "--target", "cpu", "-t", "maxtext-test:cpu", ROOT]
  build[2:2] = ["--build-arg", f"BASE_IMAGE={base}"] if base else []
  subprocess.run(build, check=True, timeout=3600)
  run = ["docker", "run", "--rm", "-v", f"{tmp_path}:/out", "maxtext-test:cpu", "cpu/smoke"]
  out = subprocess.run([*run, "base_output_directory=/out"], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  with open(tmp_path / "smoke" / "metrics.jsonl") as f:
    steps = [json.loads(line)["step"] for line in f if '"loss"' in line]
  assert max(steps) == 20
