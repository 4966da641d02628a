"""Compare this model's full-sequence logits with golden ones (e.g. from Hugging Face).

    python3 -m MaxText.check_logits CONFIG.yml load_parameters_path=PARAMS golden_logits_path=FILE.jsonl \
        [atol=1e-5] [rtol=1e-5]

FILE.jsonl: one JSON object per line, {"tokens": [...], "logits": [[...], ...]} (logits [T, V]). Prints
max absolute/relative error and KL(golden || ours) per prompt; exits 1 when any logit is outside
atol + rtol * |golden|. Runs in float32.
"""

from __future__ import annotations

import MaxText  # noqa: F401 (first: a signal during the imports below exits in one line, preemption.py)

# isort: split
import json
import sys
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText import checkpointing, launch, paths
from MaxText import state as state_lib
from MaxText.config import Config, serving_config
from MaxText.errors import ConfigError
from MaxText.layers import lora

OPTIONS = {"golden_logits_path": str, "atol": float, "rtol": float}


class Report(NamedTuple):
  max_abs: float
  max_rel: float
  kl: float
  ok: bool


def compare(golden: np.ndarray, ours: np.ndarray, atol: float, rtol: float) -> Report:
  """golden/ours [T, V] float32 logits."""
  diff = np.abs(ours - golden)
  log_p, log_q = jax.nn.log_softmax(golden, -1), jax.nn.log_softmax(ours, -1)
  kl = float(jnp.max(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)))
  rel = float(np.max(diff / np.maximum(np.abs(golden), 1e-30)))
  return Report(float(diff.max()), rel, kl, bool(np.all(diff <= atol + rtol * np.abs(golden))))


def model_logits(c: Config):
  scored = state_lib.for_inference(c)  # the decoding model: MTP modules only train
  if lora.enabled(c):  # a LoRA fine-tune: its adapters folded into the base, scored as the plain model
    params = checkpointing.load_lora_merged(scored)
    spec = state_lib.param_spec(serving_config(scored))
  else:
    spec = state_lib.param_spec(scored)
    params = checkpointing.load_params(c.load_parameters_path, spec.abstract, c)

  @jax.jit  # one program per prompt length (called eagerly, each of the model's ops was compiled on its own)
  def forward(params, tokens):  # tokens [1, T]
    t = tokens.shape[1]
    return nnx.merge(spec.graphdef, params)(tokens, jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))[0]

  def run(tokens: np.ndarray) -> np.ndarray:
    return np.asarray(forward(params, jnp.asarray(tokens)[None]), np.float32)

  return run


USAGE = launch.Usage(
  command="python3 -m MaxText.check_logits CONFIG.yml load_parameters_path=PARAMS golden_logits_path=FILE.jsonl "
  "[atol=1e-5] [rtol=1e-5] [key=value ...]",
  summary="Compare this model's full-sequence logits (float32) with golden ones; exit 1 when any is off.",
  keys=("load_parameters_path", "model_name", "scan_layers", "lora_rank", "lora_alpha", "lora_weights_path"),
  options=(
    ("golden_logits_path", 'JSON lines {"tokens": [...], "logits": [[...], ...]} (logits [T, V]); required'),
    ("atol", "absolute tolerance (default 1e-5)"),
    ("rtol", "relative tolerance (default 1e-5)"),
  ),
)


def split_options(argv: Sequence[str]) -> tuple[list[str], dict]:
  """(config argv, this command's own options); a bad value is a ConfigError."""
  options = {"atol": 1e-5, "rtol": 1e-5, "golden_logits_path": ""}
  rest = []
  for arg in argv:
    key, _, value = arg.partition("=")
    if key not in OPTIONS:
      rest.append(arg)
      continue
    try:
      options[key] = OPTIONS[key](value)
    except ValueError:
      raise ConfigError(f"{key}={value!r} must be a {OPTIONS[key].__name__}") from None
  return rest, options


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first). Exits 1 when a prompt is outside the tolerance."""
  with launch.user_errors():
    rest, opts = split_options(argv[1:])
  # Runs on this host's devices without a mesh: it joins no multi-process job.
  c = launch.start(rest, USAGE, overrides=("dtype=float32", "weight_dtype=float32"), join_job=False)
  with launch.user_errors():
    if not opts["golden_logits_path"]:
      raise ConfigError("Set golden_logits_path=FILE.jsonl")
    if not c.load_parameters_path:
      raise ConfigError("Set load_parameters_path= to the params to check")
    run, ok = model_logits(c), True  # a checkpoint that does not fit the model: one line, as train.py says it
  with paths.Path(opts["golden_logits_path"]).open() as f:  # local or gs://
    for i, line in enumerate(f):
      row = json.loads(line)
      r = compare(np.asarray(row["logits"], np.float32), run(np.asarray(row["tokens"])), opts["atol"], opts["rtol"])
      print(f"prompt {i}: max abs {r.max_abs:.3e} max rel {r.max_rel:.3e} KL {r.kl:.3e} {'ok' if r.ok else 'FAIL'}")
      ok &= r.ok
  print("PASS" if ok else f"FAIL: logits outside atol={opts['atol']} rtol={opts['rtol']}")
  if not ok:
    sys.exit(1)


if __name__ == "__main__":
  main(sys.argv)
