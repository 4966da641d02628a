"""Plot a run's metrics.jsonl (written by MaxText.metrics): loss, learning rate and gradient norm against step.

  python3 -m MaxText.plot_metrics outputs/<run>/metrics.jsonl [--output loss.png] [--smoothing 0.6]

Three panels sharing the step axis: the training loss (the logged window means, faint, and an
exponential moving average of them, solid) with the eval losses as points and perplexity (exp(loss))
on a right-hand axis; the learning rate; the gradient norm (raw and smoothed). A panel whose metric
the file lacks is left out. matplotlib is imported here only, and drawn with the Agg canvas, so no
display is needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from MaxText import paths
from MaxText.errors import StorageError

DEFAULT_SMOOTHING = 0.6  # weight of the running average per record, as TensorBoard's slider
MAX_PPL_LOSS = 30.0  # no perplexity axis past this loss: exp() of it is not readable


def read_records(path: str) -> list[dict[str, Any]]:
  """The JSON objects of a JSON-lines file (local or gs://), skipping blank lines. StorageError naming a gs://
  path that cannot be read (no credentials, no answer) within paths.PROBE_TIMEOUT_S."""
  text = paths.probe(path, lambda: paths.Path(path).read_text(), repr(path))
  return [json.loads(line) for line in text.splitlines() if line.strip()]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the records that carry a non-null `key` (non-finite values are null)."""
  points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return [s for s, _ in points], [v for _, v in points]


def smooth(values: Sequence[float], weight: float) -> list[float]:
  """Debiased exponential moving average (weight 0: the values themselves): early points are not
  pulled toward 0 as a plain EMA started at 0 would be."""
  out, avg = [], 0.0
  for i, v in enumerate(values, 1):
    avg = weight * avg + (1 - weight) * v
    out.append(avg / (1 - weight**i) if weight else v)
  return out


def _curve(ax: Any, steps: list[int], values: list[float], label: str, weight: float, color: str) -> None:
  if weight and len(values) > 2:
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
    ax.plot(steps, smooth(values, weight), color=color, label=f"{label} (smoothed)")
  else:
    ax.plot(steps, values, color=color, label=label)


def _loss_panel(ax: Any, records: list[dict[str, Any]], weight: float) -> None:
  steps, values = _series(records, "loss")
  _curve(ax, steps, values, "train loss", weight, "C0")
  eval_steps, eval_values = _series(records, "eval_loss")
  if eval_steps:
    ax.plot(eval_steps, eval_values, "o", color="C1", label="eval loss", markersize=5)
  ax.set_ylabel("loss")
  if max(values + eval_values, default=math.inf) < MAX_PPL_LOSS:
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ppl = ax.secondary_yaxis("right", functions=(_exp, _log))
    ppl.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # perplexity is exponential in loss
    ppl.yaxis.set_major_formatter(ScalarFormatter())
    ppl.set_ylabel("perplexity")


def _exp(x: Any) -> Any:
  """loss -> perplexity for the right-hand axis; matplotlib also maps values outside the data, so clamp."""
  import numpy as np

  return np.exp(np.minimum(x, MAX_PPL_LOSS))


def _log(p: Any) -> Any:
  import numpy as np

  return np.log(np.maximum(p, 1e-12))


def plot(metrics_path: str, output: str, smoothing: float = DEFAULT_SMOOTHING) -> str:
  """Write the PNG of `metrics_path` to `output` and return `output`."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  records = read_records(metrics_path)
  panels = [key for key in ("loss", "learning_rate", "grad_norm") if _series(records, key)[0]] or ["loss"]
  fig = Figure(figsize=(8, 2.6 * len(panels) + 0.6), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
  for ax, key in zip(axes, panels):
    if key == "loss":
      _loss_panel(ax, records, smoothing)
    elif key == "learning_rate":
      ax.plot(*_series(records, key), color="C2")
      ax.set_ylabel("learning rate")
      ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    else:
      _curve(ax, *_series(records, key), "grad norm", smoothing, "C3")
      ax.set_ylabel("grad norm")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(loc="upper right")
  axes[-1].set_xlabel("step")
  fig.suptitle(os.path.basename(paths.dirname(paths.absolute(metrics_path))) or metrics_path)
  paths.makedirs(paths.dirname(paths.absolute(output)))
  with paths.Path(output).open("wb") as f:  # local or gs://
    fig.savefig(f, dpi=100, format="png")
  return output


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  parser = argparse.ArgumentParser(prog="python3 -m MaxText.plot_metrics", description=__doc__.splitlines()[0])
  parser.add_argument("metrics_file", help="metrics.jsonl written by a training run")
  parser.add_argument("--output", default="", help="PNG path (default: the metrics file with .png)")
  parser.add_argument(
    "--smoothing", type=float, default=DEFAULT_SMOOTHING, help="moving-average weight in [0, 1); 0: raw curves"
  )
  args = parser.parse_args(argv[1:])
  if not 0 <= args.smoothing < 1:
    parser.error(f"--smoothing {args.smoothing}: use a weight in [0, 1), e.g. 0.6, or 0 for raw curves")
  output = args.output or os.path.splitext(args.metrics_file)[0] + ".png"
  try:
    print(f"wrote {plot(args.metrics_file, output, args.smoothing)}")
  except StorageError as e:
    sys.exit(f"Storage error: {e}")


if __name__ == "__main__":
  main(sys.argv)
