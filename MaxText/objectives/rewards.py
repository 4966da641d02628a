"""Rewards for GRPO (objectives/grpo.py): plain Python callables (prompt: str, completion: str) -> float.

rl_reward names one: a built-in (REWARDS) or `module:function` (any importable module, e.g. a file on
PYTHONPATH). A reward that raises, returns a non-number or a NaN/inf stops the run with one line naming the
prompt's row in dataset_path, before that step updates anything (checkpoints already saved are kept).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence

from MaxText.errors import ConfigError

Reward = Callable[[str, str], float]

_SUM = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)\s*=")
_INTEGER = re.compile(r"\s*-?\d+\s*")


class RewardError(ConfigError):
  """The reward function failed or gave a non-finite value; the message names the row and the prompt."""


def arithmetic(prompt: str, completion: str) -> float:
  """1.0 when the completion (surrounding whitespace ignored) is exactly the sum asked by the last `a+b=` in the
  prompt, else 0.0. A prompt without `a+b=` scores 0."""
  found = _SUM.findall(prompt)
  if not found:
    return 0.0
  a, b = found[-1]
  return float(completion.strip() == str(int(a) + int(b)))


def integer_format(prompt: str, completion: str) -> float:
  """1.0 when the completion is a bare integer (an answer in the expected format, right or wrong), else 0.0."""
  del prompt
  return float(_INTEGER.fullmatch(completion) is not None)


REWARDS: dict[str, Reward] = {"arithmetic": arithmetic, "format": integer_format}


def load(name: str) -> Reward:
  """The reward rl_reward names: a key of REWARDS, or `module:function`."""
  if name in REWARDS:
    return REWARDS[name]
  if ":" not in name:
    raise ConfigError(f"rl_reward={name!r} is not one of {', '.join(REWARDS)} nor a module:function")
  module_name, function = name.split(":", 1)
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"rl_reward={name!r}: cannot import {module_name!r} ({e}); put it on PYTHONPATH") from None
  reward = getattr(module, function, None)
  if not callable(reward):
    raise ConfigError(f"rl_reward={name!r}: {module_name} has no function {function!r}")
  return reward


def score(reward: Reward, prompts: Sequence[str], completions: Sequence[str], where: Sequence[str]) -> list[float]:
  """reward(prompt, completion) for each pair; RewardError naming the prompt's dataset row (`where`, e.g.
  "prompts.jsonl:7") on the first failure."""
  values = []
  for prompt, completion, row in zip(prompts, completions, where, strict=True):
    at = f"rl_reward on {row} (prompt {prompt[:60]!r}, completion {completion[:40]!r})"
    try:
      value = reward(prompt, completion)
    except Exception as e:  # a user's function: any error it raises is reported as that row's
      raise RewardError(f"{at} raised {type(e).__name__}: {e}") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
      raise RewardError(f"{at} returned {value!r}; it must return a finite float")
    values.append(float(value))
  return values
