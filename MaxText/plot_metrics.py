"""Plot loss and perplexity against step from a metrics.jsonl file written by MaxText.metrics.

  python3 -m MaxText.plot_metrics outputs/<run>/metrics.jsonl [--output loss.png]

Two panels: loss (train and, when present, eval) and perplexity on a log scale. matplotlib is
imported here only, and drawn with the Agg canvas, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def read_records(path: str) -> list[dict[str, Any]]:
  """The JSON objects of a JSON-lines file, skipping blank lines."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the records that carry a non-null `key` (non-finite values are null)."""
  points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return [s for s, _ in points], [v for _, v in points]


def plot(metrics_path: str, output: str) -> str:
  """Write the two-panel PNG of `metrics_path` to `output` and return `output`."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_records(metrics_path)
  fig = Figure(figsize=(8, 7), layout="constrained")
  FigureCanvasAgg(fig)
  loss_ax, ppl_ax = fig.subplots(2, 1, sharex=True)
  for ax, key, label in ((loss_ax, "loss", "loss"), (ppl_ax, "perplexity", "perplexity")):
    for prefix, style in (("", "-"), ("eval_", "o--")):
      steps, values = _series(records, prefix + key)
      if steps:
        ax.plot(steps, values, style, label=f"{prefix.rstrip('_') or 'train'} {label}", markersize=4)
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    if ax.lines:
      ax.legend()
  ppl_ax.set_yscale("log")
  ppl_ax.set_xlabel("step")
  fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(metrics_path))) or metrics_path)
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  fig.savefig(output, dpi=100)
  return output


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="python3 -m MaxText.plot_metrics", description=__doc__.splitlines()[0])
  parser.add_argument("metrics_file", help="metrics.jsonl written by a training run")
  parser.add_argument("--output", default="", help="PNG path (default: the metrics file with .png)")
  args = parser.parse_args(argv)
  output = args.output or os.path.splitext(args.metrics_file)[0] + ".png"
  print(f"wrote {plot(args.metrics_file, output)}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
