"""Assertions on a run's metrics.jsonl, for the end_to_end scripts.

python3 end_to_end/assert_metrics.py METRICS.jsonl [--steps N] [--keys a,b] [--max_final_loss X]
    [--min_loss_drop F]   # final loss <= (1 - F) x first logged loss
"""

from __future__ import annotations

import argparse
import json
import sys


def check(records: list[dict], steps: int | None, keys: list[str], max_final_loss: float | None, drop: float | None):
  train = [r for r in records if "loss" in r and "eval_loss" not in r]
  if not train:
    return ["no training records"]
  errors = []
  if steps is not None and train[-1]["step"] != steps:  # steps completed, 1 .. steps
    errors.append(f"last logged step {train[-1]['step']} != {steps}")
  errors += [f"key {k!r} missing or null in the last record" for k in keys if train[-1].get(k) is None]
  first, final = train[0]["loss"], train[-1]["loss"]
  if max_final_loss is not None and final > max_final_loss:
    errors.append(f"final loss {final:.4f} > {max_final_loss}")
  if drop is not None and final > (1 - drop) * first:
    errors.append(f"final loss {final:.4f} is not {drop:.0%} below the first logged loss {first:.4f}")
  return errors


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first). Exits 1 when a check fails."""
  parser = argparse.ArgumentParser(
    prog="python3 end_to_end/assert_metrics.py",
    epilog="More: docs/outputs.md in the repository.",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("metrics_file")
  parser.add_argument("--steps", type=int)
  parser.add_argument("--keys", default="loss")
  parser.add_argument("--max_final_loss", type=float)
  parser.add_argument("--min_loss_drop", type=float)
  args = parser.parse_args(argv[1:])
  with open(args.metrics_file) as f:
    records = [json.loads(line) for line in f if line.strip()]
  errors = check(records, args.steps, args.keys.split(","), args.max_final_loss, args.min_loss_drop)
  for e in errors:
    print(f"FAIL {args.metrics_file}: {e}", file=sys.stderr)
  if not errors:
    final = [r["loss"] for r in records if r.get("loss") is not None and "eval_loss" not in r][-1]
    print(f"OK {args.metrics_file}: {len(records)} records, final training loss {final:.4f}")
  if errors:
    sys.exit(1)


if __name__ == "__main__":
  main(sys.argv)
