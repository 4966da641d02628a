"""Print the first batches of a config's data decoded to text, one segment (document piece) per line.

python3 -m MaxText.data.inspect MaxText/configs/base.yml dataset_type=grain ... [num_batches=2] [rows=4] [eval=true]

Check the tokenizer, BOS/EOS and packing before spending compute: each row lists its segments with their
token count, first position and whether the last token has a target (it never should across documents),
then the padding. Extra arguments num_batches, rows and eval are this command's own; the rest is the config.
"""

from __future__ import annotations

import MaxText  # noqa: F401 (first: a signal during the imports below exits in one line, preemption.py)

# isort: split
import sys
from collections.abc import Sequence

import numpy as np

OWN_ARGS = {"num_batches": 2, "rows": 4, "eval": False}


def describe_row(batch: dict[str, np.ndarray], row: int, tokenizer) -> list[str]:
  """Lines describing row `row` of a numpy batch: one per segment, then one for the padding."""
  seg, lines = batch["inputs_segmentation"][row], []
  for s in [s for s in dict.fromkeys(seg.tolist()) if s]:
    where = seg == s
    ids = batch["inputs"][row][where]
    text = tokenizer.decode(ids) if tokenizer else " ".join(map(str, ids[:32]))
    last_target = bool(batch["targets_segmentation"][row][where][-1])
    head = f"  segment {s}: {len(ids)} tokens from position {batch['inputs_position'][row][where][0]}"
    bos, eos = (getattr(tokenizer, name, -1) for name in ("bos_id", "eos_id"))
    ends = "+".join(name for name, hit in (("BOS", ids[0] == bos), ("EOS", ids[-1] == eos)) if hit)
    lines.append(f"{head} {ends}{' (last token has a target!)' * last_target}".rstrip())
    lines.append("    | " + text.replace("\n", "\n    | "))
    trained = batch["targets_segmentation"][row][where][:-1] != 0
    if tokenizer and 0 < trained.sum() < len(ids) - 1:  # use_sft: say which tokens the loss covers
      lines.append(f"    loss on {int(trained.sum())} tokens: {tokenizer.decode(ids[1:][trained])!r}")
  padding = int((seg == 0).sum())
  if padding:
    lines.append(f"  padding: {padding} tokens")
  return lines


def split_args(argv: Sequence[str]) -> tuple[list[str], dict]:
  """(config argv, this command's own options)."""
  own, rest = dict(OWN_ARGS), []
  for arg in argv:
    key, _, value = arg.partition("=")
    if key in own:
      own[key] = value.lower() == "true" if isinstance(own[key], bool) else int(value)
    else:
      rest.append(arg)
  return rest, own


def usage():
  from MaxText import launch

  return launch.Usage(
    command="python3 -m MaxText.data.inspect MaxText/configs/base.yml dataset_type=grain ... "
    "[num_batches=2] [rows=4] [eval=true]",
    summary="Print the first batches of a config's data decoded to text, one segment per line.",
    keys=(
      "dataset_type", "dataset_path", "tokenizer_type", "tokenizer_path", "add_bos", "add_eos", "packing",
      "max_target_length", "per_device_batch_size", "eval_fraction",
    ),
    options=(
      ("num_batches", f"batches to print (default {OWN_ARGS['num_batches']})"),
      ("rows", f"rows of each batch to print (default {OWN_ARGS['rows']})"),
      ("eval", "true: the eval split instead of the train split"),
    ),
  )  # fmt: skip


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  import jax

  from MaxText import data, launch, sharding

  config_argv, own = split_args(argv[1:])
  config = launch.start(config_argv, usage())
  with launch.user_errors():
    mesh = sharding.create_mesh(config)
    its = data.make_iterators(config, mesh)
  if own["eval"] and its.eval_factory is None:
    sys.exit("This config has no eval data")
  batches = its.eval_factory() if own["eval"] else its.train
  for index, batch in zip(range(own["num_batches"]), batches):
    local = {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}
    if jax.process_index() == 0:
      print(
        f"=== batch {index}: {local['inputs'].shape} int32, {int((local['targets_segmentation'] > 0).sum())} targets"
      )
      for row in range(min(own["rows"], len(local["inputs"]))):
        print(f"row {row}:", *describe_row(local, row, its.tokenizer), sep="\n")


if __name__ == "__main__":
  main(sys.argv)
