"""Offline distillation's generation step: run the teacher over the training data once and store its top-k
logits per token, with the tokens, as ArrayRecord shards (objectives/topk.py; docs/distillation.md).

python3 -m MaxText.distill_topk CONFIG.yml objective=distill teacher_config=... teacher_load_parameters_path=... \
  distill_topk_path=DIR distill_topk_k=16 [steps=N eval_steps=M ...]

The config is the student's online one (its data, tokenizer, batch and length): `steps` train batches and
`eval_steps` eval batches are written; a student then trains with objective=distill distill_topk_path=DIR.
"""

from __future__ import annotations

import MaxText  # noqa: F401 (first: a signal during the imports below exits in one line, preemption.py)

# isort: split
import functools
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import checkpointing, launch, paths, sharding, teacher
from MaxText import data as data_lib
from MaxText import state as state_lib
from MaxText.config import Config
from MaxText.errors import ConfigError
from MaxText.objectives import distill, topk


def check(config: Config) -> None:
  """What generation cannot run with, one line each, before anything is built."""
  if config.objective != "distill" or not config.distill_topk_path:
    raise ConfigError("python3 -m MaxText.distill_topk takes objective=distill and distill_topk_path=DIR (the output)")
  if not 0 < config.distill_topk_k <= config.vocab_size:
    raise ConfigError(f"distill_topk_k={config.distill_topk_k} must be in [1, vocab_size={config.vocab_size}]")
  if jax.process_count() > 1:
    raise ConfigError("python3 -m MaxText.distill_topk runs as one process (the teacher on its local devices)")
  if paths.exists(os.path.join(config.distill_topk_path, topk.META_FILE)):
    raise ConfigError(
      f"distill_topk_path={config.distill_topk_path!r} already holds top-k shards: give a new directory"
    )
  distill.check(config.replace(distill_topk_path=""))


def teacher_topk(config: Config, k: int, params, batch):
  """The teacher's top-k logits and ids [B, T, k], the log-sum-exp of its logits / distill_temperature and its
  log p(target) [B, T] on one batch."""
  model = distill.teacher_model(config, params)
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"], None)
  logits = model.logits(model.forward(*inputs, hidden_only=True).logits).astype(jnp.float32)
  values, ids = jax.lax.top_k(logits, k)
  target_logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), batch["targets"][..., None], axis=-1)
  lse = jax.nn.logsumexp(logits / config.distill_temperature, axis=-1)
  return values, ids, lse, target_logp[..., 0]


def write_split(writer: topk.Writer, fn, params, batches, count: int) -> None:
  """`count` batches of `batches` (-1: all of them) with the teacher's top-k, one record per row."""
  for done, batch in enumerate(batches, 1):
    values, ids, lse, logp = jax.device_get(fn(params, batch))
    host = {k: np.asarray(v) for k, v in jax.device_get(batch).items()}
    for i in range(len(values)):
      row = {k: v[i] for k, v in host.items()} | {"topk_values": values[i], "topk_ids": ids[i]}
      writer.write(row | {"teacher_lse": lse[i], "teacher_logp": logp[i]})
    if done == count:
      break
  writer.close()


def run(config: Config) -> topk.Meta:
  """Write config.steps train batches and config.eval_steps eval batches of the teacher's top-k."""
  check(config)
  out = config.distill_topk_path
  config = config.replace(distill_topk_path="")  # the online config: the teacher runs
  mesh = sharding.create_mesh(config)
  os.makedirs(out, exist_ok=True)
  with sharding.activate(config, mesh):
    spec = state_lib.param_spec(teacher.config_of(config), mesh)
    params = checkpointing.load_params(config.teacher_load_parameters_path, spec.abstract)
    iterators = data_lib.make_iterators(config, mesh)
    fn = jax.jit(functools.partial(teacher_topk, config, config.distill_topk_k))
    rows = {}
    for split, batches, count in (("train", iterators.train, config.steps), ("eval", None, config.eval_steps)):
      if split == "eval":
        if iterators.eval_factory is None:
          continue
        batches = iterators.eval_factory()
      writer = topk.Writer(out, split)
      write_split(writer, fn, params, batches, count)
      rows[split] = writer.rows
  digest = topk.tokenizer_digest(config)
  k, temperature = config.distill_topk_k, config.distill_temperature
  meta = topk.Meta(k, config.vocab_size, config.max_target_length, temperature, digest, rows)
  topk.write_meta(out, meta)
  print(f"wrote the teacher's top-{meta.k} logits of {rows} rows to {out}", flush=True)
  return meta


USAGE = launch.Usage(
  command="python3 -m MaxText.distill_topk CONFIG.yml objective=distill teacher_config=... "
  "teacher_load_parameters_path=... distill_topk_path=DIR [distill_topk_k=16 steps=N eval_steps=M]",
  summary="Store a teacher's top-k logits over the training data for offline distillation (docs/distillation.md).",
  keys=("teacher_config", "teacher_load_parameters_path", "distill_topk_path", "distill_topk_k", "steps", "eval_steps"),
)


def main(argv: Sequence[str]) -> None:
  config = launch.start(argv[1:], USAGE)
  with launch.user_errors():
    run(config)


if __name__ == "__main__":
  main(sys.argv)
