"""Training objectives, one module each, run by the one trainer (train.py, train_step.py; docs/objectives.md).

`objective: lm | dpo | grpo | distill | simpo | orpo` in the config picks one from REGISTRY (use_dpo=true is an
alias of objective=dpo).
The protocol an objective follows is objectives/base.py's Objective.
"""

from __future__ import annotations

from MaxText.config import Config
from MaxText.errors import ConfigError
from MaxText.objectives import distill, dpo, grpo, lm, orpo, simpo
from MaxText.objectives.base import Objective

REGISTRY: dict[str, Objective] = {"lm": lm.OBJECTIVE, "dpo": dpo.OBJECTIVE, "grpo": grpo.OBJECTIVE}
REGISTRY["distill"] = distill.OBJECTIVE  # a frozen teacher: TrainState.reference (teacher.py)
REGISTRY |= {"simpo": simpo.OBJECTIVE, "orpo": orpo.OBJECTIVE}  # reference-free preference objectives


def get(config: Config) -> Objective:
  """The objective config.objective names."""
  if config.objective not in REGISTRY:
    raise ConfigError(f"objective={config.objective!r} is not one of {', '.join(REGISTRY)}")
  return REGISTRY[config.objective]
