"""The objectives (MaxText/objectives/): one registry whose names are the config's choices, use_dpo=true as the
alias of objective=dpo (read in one place), a bad objective named in one line, and python3 -m MaxText.rl as the
alias of objective=grpo, for training and for AOT compilation."""

import ast
import os

import pytest

from MaxText import config, objectives, rl, train, train_compile
from MaxText import state as state_lib
from MaxText.errors import ConfigError
from MaxText.objectives import base
from MaxText.tests.conftest import BASE, ROOT, TINY

PROTOCOL = ("name", "reference", "perplexity", "denominator", "fields", "sum_keys", "loss_sums", "step_metrics",
            "eval_sums", "eval_metrics", "sources", "check")  # fmt: skip


@pytest.mark.quick
def test_the_registry_names_the_config_choices_and_each_objective_follows_the_protocol():
  assert tuple(objectives.REGISTRY) == config.CHOICES["objective"]
  assert {"lm", "dpo", "grpo", "distill", "simpo", "orpo"} <= set(objectives.REGISTRY)
  for name, objective in objectives.REGISTRY.items():
    assert objective.name == name and all(hasattr(objective, key) for key in PROTOCOL), name
    assert objective.denominator in objective.sum_keys(config.load([BASE, *TINY], {}))
  referenced = tuple(k for k, o in objectives.REGISTRY.items() if o.reference)
  assert referenced == state_lib.REFERENCE_OBJECTIVES  # the train state keeps a reference copy for these


def dpo_args(tmp_path, *overrides):
  (tmp_path / "tokenizer.json").write_text("{}")
  data = ["dataset_type=text", f"dataset_path={tmp_path}/pairs.jsonl", "tokenizer_type=huggingface"]
  return [BASE, *TINY, *data, f"tokenizer_path={tmp_path}/tokenizer.json", *overrides]


@pytest.mark.quick
def test_use_dpo_is_an_alias_of_objective_dpo(tmp_path):
  assert config.load([BASE, *TINY], {}).objective == "lm"
  assert config.load(dpo_args(tmp_path, "use_dpo=true"), {}).objective == "dpo"
  assert config.load(dpo_args(tmp_path, "objective=dpo"), {}).objective == "dpo"
  assert config.load(dpo_args(tmp_path, "use_dpo=true", "objective=dpo"), {}).objective == "dpo"
  with pytest.raises(ConfigError, match=r"use_dpo=true \(an alias of objective=dpo\) and objective=grpo"):
    config.load(dpo_args(tmp_path, "use_dpo=true", "objective=grpo"), {})


@pytest.mark.quick
def test_a_bad_objective_is_one_line_with_the_choices():
  with pytest.raises(ConfigError) as e:
    config.load([BASE, *TINY, "objective=kto"], {})
  choices = ", ".join(map(repr, config.CHOICES["objective"]))
  assert str(e.value) == f"objective='kto' is not one of {choices}" and "'simpo', 'orpo'" in choices


def test_use_dpo_is_read_in_one_place():
  """Every other module reads config.objective: the alias is resolved where the config is loaded."""
  readers = []
  for folder, _, names in os.walk(os.path.join(ROOT, "MaxText")):
    for name in names:
      if not name.endswith(".py") or "tests" in folder.split(os.sep):
        continue
      path = os.path.join(folder, name)
      with open(path) as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        attribute = isinstance(node, ast.Attribute) and node.attr == "use_dpo"
        key = isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "use_dpo"
        if attribute or key:
          readers.append(os.path.relpath(path, ROOT))
  assert readers == ["MaxText/config.py"], readers


@pytest.mark.quick
def test_python_m_maxtext_rl_runs_the_trainer_with_objective_grpo(monkeypatch):
  seen = []
  monkeypatch.setattr(train, "main", lambda argv, usage, overrides: seen.append(("train", argv, overrides)))
  monkeypatch.setattr(train_compile, "main", lambda argv, usage, overrides: seen.append(("aot", argv, overrides)))
  rl.main(["rl.py", BASE, "steps=2"])
  rl.main(["rl.py", BASE, "compile_topology=v5e-8"])
  assert seen == [
    ("train", ["rl.py", BASE, "steps=2"], ("objective=grpo",)),
    ("aot", ["rl.py", BASE, "compile_topology=v5e-8"], ("objective=grpo",)),
  ]


def test_the_alias_reaches_the_config(monkeypatch, tmp_path):
  """train.main with rl's overrides loads objective=grpo, whatever the command line says of it."""
  loaded = []
  monkeypatch.setattr(train, "run", lambda c, **kwargs: loaded.append(c.objective) or {"steps_run": 0})
  args = [BASE, *TINY, f"base_output_directory={tmp_path}", "run_name=alias", "objective=lm"]
  train.main(["rl.py", *args], rl.USAGE, ("objective=grpo",))
  assert loaded == ["grpo"]


@pytest.mark.quick
def test_a_data_iterator_is_a_batch_source():
  class Counter:
    def __init__(self):
      self.n = 0

    def __next__(self):
      self.n += 1
      return {"inputs": self.n}

    def get_state(self):
      return {"n": self.n}

    def set_state(self, state):
      self.n = state["n"]

  source = base.DataBatches(Counter())
  assert source.next(None) == ({"inputs": 1}, {}) and source.get_state() == {"n": 1}
  source.set_state({"n": 5})
  assert source.next(object()).batch == {"inputs": 6} and source.describe() == []


@pytest.mark.slow  # three compiles: the step, the sampler's prefill and its decode step
def test_python_m_maxtext_rl_compiles_the_step_and_the_sampler_ahead_of_time(tmp_path, capsys):
  (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1="}\n')
  args = [BASE, *TINY, f"base_output_directory={tmp_path}", "run_name=aot", "vocab_size=264", "max_target_length=16",
          "max_prefill_predict_length=8", "decode_sampling_strategy=weighted", "decode_max_new_tokens=3",
          "per_device_batch_size=1", f"dataset_path={tmp_path}/prompts.jsonl", "compile_topology=cpu"]  # fmt: skip
  rl.main(["rl.py", *args])
  out = capsys.readouterr().out
  assert out.startswith("compiled for 8 x cpu") and "\nsample_prefill: compiled for 8 x cpu" in out
  assert "\nsample_step: compiled for" in out and "the reference params: 0.00 GiB per device" in out
