"""Decode: config -> mesh -> params (checkpoint, or random weights) -> prefill + generate -> text.

python3 MaxText/decode.py MaxText/configs/base.yml run_name=d prompt="I love to"
python3 MaxText/decode.py quickstart load_parameters_path=outputs/quickstart/checkpoints/400/state \
  prompt="import os" decode_max_new_tokens=64
python3 MaxText/decode.py CONVERTED/config.yml load_parameters_path=CONVERTED/params image_path=cat.png \
  prompt="Describe the image."    # a vision-language model (use_multimodal): the image goes before the text
python3 MaxText/decode.py CONFIG.yml load_parameters_path=BASE lora_rank=R lora_alpha=A \
  lora_weights_path=RUN_DIR/checkpoints/STEP/state prompt="..."    # a LoRA fine-tune, merged at load

One row by default: the prompt decoded once. per_device_batch_size=N on the command line asks for the
training-style batch instead (the prompt repeated on per_device_batch_size x devices rows, which must split
over the mesh's batch axes). No dataset is needed: the tokenizer is tokenizer_path, else the one a text run
cached in its run directory, else UTF-8 bytes (MaxText/inference/tokenizer.py)."""

from __future__ import annotations

try:  # first: a signal during the imports below exits in one line (preemption.py)
  import MaxText  # noqa: F401
except ModuleNotFoundError as e:  # run as a file with the requirements alone: say what installs the package
  raise SystemExit(f"{e}: run `bash setup.sh` (or `pip install -e .` in this environment) first") from None

# isort: split
import logging
import os
import sys
from collections.abc import Sequence

import jax

from MaxText import launch, planner, saved_config, sharding
from MaxText.config import Config
from MaxText.inference import Engine, Generation, quantize

SHOWN_ROWS = 4  # rows printed when they differ (sampling)


def report(config: Config, engine: Engine, result: Generation) -> str:
  lines = [f"Parameters: {engine.source}", f"Tokenizer: {engine.tokenizer.path}"]
  lines += [f"Plan: {line}" for line in planner.describe(engine.plan, config)]
  lines.append(f"Prompt: {config.prompt!r}" + (f" with image(s) {config.image_path}" if config.image_path else ""))
  texts = result.texts
  shown = texts[:1] if len(set(texts)) == 1 else texts[:SHOWN_ROWS]
  for i, text in enumerate(shown):
    lines.append(f"Output{'' if len(shown) == 1 else f' [{i}]'}: {text!r} ({result.completions[i].finish_reason})")
  lines.append(
    f"Time to first token: {result.time_to_first_token_s:.3f} s | decode: {result.decode_tokens_per_s:.1f} tokens/s "
    f"({len(texts)} row{'' if len(texts) == 1 else 's'} x {result.num_steps} steps)"
  )
  return "\n".join(lines)


def run(config: Config, rows: int | None = None) -> Generation:
  """Decode `config.prompt` on `rows` rows (padded to the mesh's batch shards), or with rows=None on the
  config's global batch (per_device_batch_size x devices, which must split over the batch axes)."""
  mesh = sharding.create_mesh(config)  # every process's devices after launch.start joined the job
  batch = sharding.global_batch_size(config, mesh) if rows is None else rows
  engine = Engine.load(config, mesh)
  if config.save_quantized_params_path:
    quantize.save(config.save_quantized_params_path, engine.params)
    if jax.process_index() == 0:
      print(f"Saved int8 params to {config.save_quantized_params_path} (load_parameters_path for decode)", flush=True)
  images = None
  if config.image_path:  # the same image(s) on every row
    images = [[p.strip() for p in config.image_path.split(",") if p.strip()]] * batch
  result = engine.generate([config.prompt] * batch, stop_strings=config.decode_stop_strings, images=images)
  if jax.process_index() == 0:  # every process holds the same texts
    print(report(config, engine, result), flush=True)
  return result


USAGE = launch.Usage(
  command='python3 MaxText/decode.py CONFIG.yml [load_parameters_path=PARAMS] prompt="I love to" '
  "[per_device_batch_size=N: a batch instead of one row] [key=value ...]",
  summary="Decode: config -> params (checkpoint, or random weights) -> prefill + generate -> text.",
  keys=(
    "prompt", "image_path", "load_parameters_path", "model_name", "tokenizer_path", "per_device_batch_size",
    "max_prefill_predict_length", "max_target_length", "decode_max_new_tokens", "decode_sampling_strategy",
    "decode_sampling_temperature", "decode_sampling_top_k", "decode_sampling_nucleus_p", "decode_seed",
    "decode_stop_strings", "quantization", "quantize_kvcache", "kv_quant_dtype", "save_quantized_params_path",
    "ici_fsdp_parallelism", "ici_tensor_parallelism", "lora_rank", "lora_alpha", "lora_weights_path",
  ),
)  # fmt: skip


def main(argv: Sequence[str]) -> None:
  """argv: sys.argv (the program name first)."""
  config = launch.start(argv[1:], USAGE)
  logging.getLogger("absl").addFilter(_no_missing_metadata_warning)
  # A training config's batch (quickstart: 8 rows per device) would decode the same prompt on every row;
  # one row unless the command line or M_PER_DEVICE_BATCH_SIZE asks for a batch.
  asked = any(a.startswith("per_device_batch_size=") for a in argv[1:]) or "M_PER_DEVICE_BATCH_SIZE" in os.environ
  with launch.user_errors():
    saved_config.check(config)  # a checkpoint of another architecture, named before any device work
    run(config, rows=None if asked else 1)


def _no_missing_metadata_warning(record: logging.LogRecord) -> bool:
  """orbax warns "Metadata file does not exist" on every restore of a params directory without a
  checkpoint-level metadata file (a train checkpoint's state/, a converted params/): harmless, so hidden."""
  return "Metadata file does not exist" not in record.getMessage()


if __name__ == "__main__":
  main(sys.argv)
