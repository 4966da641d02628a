"""python3 -m MaxText.rl CONFIG.yml ...: GRPO, an alias of `python3 MaxText/train.py CONFIG.yml ... objective=grpo`
(with compile_topology=..., of train_compile.py's). The objective is MaxText/objectives/grpo.py (docs/rl.md)."""

from __future__ import annotations

import MaxText  # noqa: F401 (first: a signal during the imports below exits in one line, preemption.py)

# isort: split
import sys
from collections.abc import Sequence

from MaxText import launch, train, train_compile

USAGE = launch.Usage(
  command="python3 -m MaxText.rl CONFIG.yml load_parameters_path=PARAMS rl_reward=NAME dataset_path=prompts.jsonl",
  summary="GRPO (objective=grpo): sample num_generations completions per prompt, reward them, update with the "
  "clipped ratio + KL.",
  keys=("load_parameters_path", "rl_reward", "dataset_path", "rl_prompt_column", "num_generations", "grpo_beta",
        "grpo_epsilon", "decode_max_new_tokens", "decode_sampling_strategy", "decode_sampling_temperature",
        "per_device_batch_size", "steps", "learning_rate", "checkpoint_period"),
)  # fmt: skip


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  compiles = any(a.startswith("compile_topology=") and a != "compile_topology=" for a in argv)
  (train_compile.main if compiles else train.main)(argv, usage=USAGE, overrides=("objective=grpo",))


if __name__ == "__main__":
  main(sys.argv)
