"""Decode: config -> mesh -> params (checkpoint, or random weights) -> prefill + generate -> text.

python3 MaxText/decode.py MaxText/configs/base.yml run_name=d prompt="I love to"
python3 MaxText/decode.py MaxText/configs/quickstart.yml \
  load_parameters_path=outputs/quickstart/checkpoints/400/state prompt="def "

The prompt is repeated on every row of the batch (per_device_batch_size x devices rows, which must
split over the mesh's batch axes). No dataset is needed: the tokenizer is tokenizer_path, else the one
a text run cached in its run directory, else UTF-8 bytes (MaxText/inference/tokenizer.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

if __package__ in (None, ""):  # run as a script: import the package from the repository root
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import config as config_lib
from MaxText import sharding
from MaxText.config import Config, ConfigError
from MaxText.inference import Engine, Generation

SHOWN_ROWS = 4  # rows printed when they differ (sampling)


def report(config: Config, engine: Engine, result: Generation) -> str:
  lines = [f"Parameters: {engine.source}", f"Tokenizer: {engine.tokenizer.path}", f"Prompt: {config.prompt!r}"]
  texts = result.texts
  shown = texts[:1] if len(set(texts)) == 1 else texts[:SHOWN_ROWS]
  for i, text in enumerate(shown):
    lines.append(f"Output{'' if len(shown) == 1 else f' [{i}]'}: {text!r} ({result.completions[i].finish_reason})")
  lines.append(
    f"Time to first token: {result.time_to_first_token_s:.3f} s | decode: {result.decode_tokens_per_s:.1f} tokens/s "
    f"({len(texts)} rows x {result.num_steps} steps)"
  )
  return "\n".join(lines)


def run(config: Config) -> Generation:
  mesh = sharding.create_mesh(config)
  batch = sharding.global_batch_size(config, mesh)
  engine = Engine.load(config, mesh)
  result = engine.generate([config.prompt] * batch, stop_strings=config.decode_stop_strings)
  print(report(config, engine, result), flush=True)
  return result


def main(argv: Sequence[str]) -> None:
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
  try:
    run(config_lib.load(argv))
  except ConfigError as e:
    sys.exit(f"Configuration error: {e}")


if __name__ == "__main__":
  main(sys.argv[1:])
