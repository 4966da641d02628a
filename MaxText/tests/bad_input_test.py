"""Bad input: every case runs an entry point's real main and must exit 1 with exactly one line on stderr that
names the key or path, with no traceback anywhere. A case whose input is knowable from the config alone (or a
checkpoint's saved config and shapes) must fail before anything is compiled; a data case (found when the files
are opened) before the train step is built.

Most cases run main in-process (run_main: SystemExit and stderr as the interpreter would produce them, a
compile counter from jax.monitoring); a few run as real subprocesses to show that the in-process verdict is
the one a user sees.
"""

import contextlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
import pytest

from MaxText import checkpointing, config, decode, launch, state, train
from MaxText.convert import hf_to_maxtext
from MaxText.data import convert_to_arrayrecord, files, inspect, train_tokenizer
from MaxText.tests.conftest import BASE, ROOT, TINY

pytestmark = pytest.mark.usefixtures("no_compile_cache")  # these tests count compilations: no cache hits

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]


def _count_compiles(event: str, duration: float, **kwargs) -> None:
  if event == COMPILE_EVENT:
    _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


class Outcome(NamedTuple):
  code: int  # the process exit status the interpreter would give
  stdout: str
  stderr: str
  compiles: int  # XLA compilations during the call


def run_main(main: Callable[[list[str]], None], argv: Sequence[str]) -> Outcome:
  """`main(argv)` in-process, with SystemExit and uncaught errors turned into what the interpreter prints."""
  out, err = io.StringIO(), io.StringIO()
  before = _compiles[0]
  code = 0
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _progress_into(err):
    try:
      main(list(argv))
    except SystemExit as e:
      if isinstance(e.code, str):  # sys.exit("message"): printed to stderr, status 1
        print(e.code, file=sys.stderr)
        code = 1
      else:
        code = e.code or 0
    except Exception:  # what the interpreter does with an uncaught error
      traceback.print_exc()
      code = 1
  return Outcome(code, out.getvalue(), err.getvalue(), _compiles[0] - before)


@contextlib.contextmanager
def _progress_into(err: io.StringIO):
  """Our progress handler (launch.setup_logging: made once per process, bound to the stderr of that moment,
  which an earlier test may have closed since) writes into `err` for this run."""
  handler = next((h for h in logging.getLogger("MaxText").handlers if h.get_name() == launch.LOG_HANDLER), None)
  if handler is None:
    yield
    return
  previous, handler.stream = handler.stream, err
  try:
    yield
  finally:
    handler.stream = previous


class Case(NamedTuple):
  entry: str  # train | decode | convert
  args: tuple[str, ...]  # after the config file, or (argparse tools) after the program name; {d}: a scratch dir
  names: str  # the key or path the one line must name
  knowable: bool = True  # from the config alone: must fail before any compilation


def T(names: str, *args: str, knowable: bool = True) -> Case:
  return Case("train", args, names, knowable)


def D(names: str, *args: str) -> Case:  # data: found once files are opened, after the mesh is built
  return Case("train", args, names, knowable=False)


CONVERT = ("--output={d}/out",)
SP = ("tokenizer_path={sp}", "vocab_size=512")  # the corpus fixture's SentencePiece model (466 pieces)


def hf(directory: str) -> str:
  return f"--hf_path={{d}}/{directory}"


CASES = {
  # optimizer values that trained silently before
  "negative_learning_rate": T("learning_rate", "learning_rate=-1"),
  "zero_adam_eps": T("adam_eps", "adam_eps=0"),
  "negative_adam_eps": T("adam_eps", "adam_eps=-1e-8"),
  "negative_clipping": T("gradient_clipping_threshold", "gradient_clipping_threshold=-1"),
  "adam_b1_one": T("adam_b1", "adam_b1=1.0"),
  "adam_b2_negative": T("adam_b2", "adam_b2=-0.1"),
  "negative_weight_decay": T("adam_weight_decay", "adam_weight_decay=-0.1"),
  "final_lr_fraction": T("cosine_learning_rate_final_fraction", "cosine_learning_rate_final_fraction=2"),
  # eval with nothing to evaluate
  "eval_text_no_holdout": T("eval_fraction", "dataset_type=text", "eval_fraction=0", "eval_interval=2"),
  "eval_grain_no_files": T(
    "grain_eval_files", "dataset_type=grain", "grain_train_files={d}/x", "tokenizer_path={d}/tok", "eval_interval=2"
  ),
  "eval_hf_no_split": T(
    "hf_eval_split", "dataset_type=hf", "hf_path=json", "tokenizer_path={d}/tok", "eval_interval=2"
  ),
  "eval_tfds_no_split": T(
    "eval_split", "dataset_type=tfds", "eval_split=", "tokenizer_path={d}/tok", "eval_interval=2"
  ),
  "eval_steps_zero": T("eval_steps", "eval_interval=2", "eval_steps=0"),
  "eval_text_one_document": D(
    "eval_interval", "dataset_type=text", "dataset_path={d}/one/*.txt", *SP, "eval_interval=2"
  ),
  # shapes: head_dim and dimensions that do not divide their mesh axes
  "odd_head_dim": T("head_dim", "head_dim=15"),
  "kv_heads_over_tensor": T("base_num_kv_heads", "ici_tensor_parallelism=4"),
  "query_heads_over_tensor": T(
    "base_num_query_heads", "ici_tensor_parallelism=8", "base_num_query_heads=4", "base_num_kv_heads=4"
  ),
  "vocab_over_tensor": T(
    "vocab_size", "ici_tensor_parallelism=8", "base_num_query_heads=8", "base_num_kv_heads=8", "vocab_size=250"
  ),
  "mlp_over_tensor": T("base_mlp_dim", "ici_tensor_parallelism=2", "base_mlp_dim=127"),
  "emb_over_fsdp": T("base_emb_dim", "base_emb_dim=60"),
  "experts_over_expert_axis": T(
    "num_experts", "num_experts=3", "num_experts_per_tok=1", "ici_expert_parallelism=2", "ici_fsdp_parallelism=-1"
  ),
  "fsdp_not_dividing_devices": T("ici_fsdp_parallelism", "ici_fsdp_parallelism=3", "base_emb_dim=96"),
  "two_fill_axes": T("ici_data_parallelism", "ici_data_parallelism=-1"),
  "batch_not_whole": T("per_device_batch_size", "per_device_batch_size=0.1"),
  "global_scale_not_power": T("global_parameter_scale", "global_parameter_scale=3"),
  "query_chunk": T("attention_query_chunk", "attention_query_chunk=7"),
  "vocab_tiling": T("num_vocab_tiling", "num_vocab_tiling=5"),
  # values and keys
  "unknown_key": T("learning_rat", "learning_rat=1"),
  "not_an_integer": T("steps", "steps=abc"),
  "zero_steps": T("steps", "steps=0"),
  "bad_dtype": T("dtype", "dtype=float8"),
  "bad_model_name": T("model_name", "model_name=nope"),
  "zero_batch": T("per_device_batch_size", "per_device_batch_size=0"),
  "dropout_above_one": T("dropout_rate", "dropout_rate=1.5"),
  "experts_per_token": T("num_experts_per_tok", "num_experts=4", "num_experts_per_tok=8"),
  "llama3_rope": T("rope_low_freq_factor", "rope_type=llama3", "rope_low_freq_factor=5"),
  "not_key_value": T("'foo'", "foo"),
  "tpu_on_cpu": T("hardware=tpu", "hardware=tpu"),
  "missing_params": T("load_parameters_path", "load_parameters_path={d}/nope"),
  "missing_tokenizer": T("tokenizer_path", "dataset_type=text", "tokenizer_path={d}/nope"),  # synthetic data reads none
  "grain_without_files": T("grain_train_files", "dataset_type=grain", "tokenizer_path={d}/tok"),
  "hf_without_path": T("hf_path", "dataset_type=hf", "tokenizer_path={d}/tok"),
  # outputs
  "output_dir_under_file": T("base_output_directory", "base_output_directory={d}/afile/out"),
  "metrics_under_file": T("metrics_file", "metrics_file={d}/afile/m.jsonl"),
  "metrics_is_dir": T("metrics_file", "metrics_file={d}"),
  "output_dir_in_proc": T("base_output_directory", "base_output_directory=/proc/x"),  # root may write anywhere else
  "metrics_in_proc": T("metrics_file", "metrics_file=/proc/m.jsonl"),
  "flash_length_on_cpu": T("max_target_length", "attention=flash", "max_target_length=96"),
  # checkpoints of another architecture
  "resume_other_architecture": T(
    "emb_dim", "base_output_directory={d}/runs", "run_name=old", "enable_checkpointing=true"
  ),
  "full_state_other_architecture": T("load_full_state_path", "load_full_state_path={d}/runs/old/checkpoints/1/state"),
  "params_other_architecture": T("load_parameters_path", "load_parameters_path={d}/runs/old/checkpoints/1/state"),
  "decode_params_other_architecture": Case(
    "decode", ("load_parameters_path={d}/runs/old/checkpoints/1/state",), "load_parameters_path"
  ),
  "decode_params_no_config_yml": Case("decode", ("load_parameters_path={d}/params128",), "load_parameters_path"),
  "train_params_no_config_yml": T("load_parameters_path", "load_parameters_path={d}/params128"),
  "train_full_state_no_config_yml": T("load_full_state_path", "load_full_state_path={d}/params128"),
  "resume_no_config_yml": T(
    "run_name='noyml'", "base_output_directory={d}/runs", "run_name=noyml", "enable_checkpointing=true"
  ),
  "decode_bad_sampling": Case("decode", ("decode_sampling_nucleus_p=0",), "decode_sampling_nucleus_p"),
  # data (the 18): text corpora, tokenizers, grain, hf
  "text_no_match": D("{d}/nope", "dataset_type=text", "dataset_path={d}/nope/*.txt"),
  "text_directory": D("{d}/docs", "dataset_type=text", "dataset_path={d}/docs"),
  "text_empty_file": D("{d}/empty", "dataset_type=text", "dataset_path={d}/empty/*.txt"),
  "text_binary_file": D("binary.txt", "dataset_type=text", "dataset_path={d}/binary.txt"),
  "text_utf16_file": D("utf16.txt", "dataset_type=text", "dataset_path={d}/utf16.txt"),
  "jsonl_missing_column": D("text_column", "dataset_type=text", "dataset_path={d}/good.jsonl", "text_column=body"),
  "jsonl_typed_column": D("typed.jsonl", "dataset_type=text", "dataset_path={d}/typed.jsonl"),
  "jsonl_malformed_line": D("bad.jsonl:2", "dataset_type=text", "dataset_path={d}/bad.jsonl"),
  "jsonl_list_line": D("list.jsonl:1", "dataset_type=text", "dataset_path={d}/list.jsonl"),
  "parquet_garbage": D("fake.parquet", "dataset_type=text", "dataset_path={d}/fake.parquet"),
  "sentencepiece_garbage": D("{d}/tok", "dataset_type=text", "dataset_path={d}/docs/*.txt", "tokenizer_path={d}/tok"),
  "huggingface_tokenizer_garbage": D(
    "{d}/tok",
    "dataset_type=text",
    "dataset_path={d}/docs/*.txt",
    "tokenizer_path={d}/tok",
    "tokenizer_type=huggingface",
  ),  # fmt: skip
  "tiktoken_tokenizer_garbage": D(
    "{d}/tok", "dataset_type=text", "dataset_path={d}/docs/*.txt", "tokenizer_path={d}/tok", "tokenizer_type=tiktoken"
  ),
  "vocab_below_tokenizer": D("vocab_size", "dataset_type=text", "dataset_path={d}/docs/*.txt", "tokenizer_path={sp}"),
  "grain_no_match": D("{d}/nope", "dataset_type=grain", "grain_train_files={d}/nope/*", *SP),
  "grain_fake_arrayrecord": D("fake.arrayrecord", "dataset_type=grain", "grain_train_files={d}/fake.arrayrecord", *SP),
  "grain_fake_parquet": D(
    "fake.parquet",
    "dataset_type=grain",
    "grain_file_type=parquet",
    "grain_train_files={d}/fake.parquet",
    *SP,
  ),  # fmt: skip
  "grain_bad_mixture": D("mixture", "dataset_type=grain", "grain_train_files={d}/fake.arrayrecord,0", *SP),
  "grain_unreachable_gs": D("gs://", "dataset_type=grain", "grain_train_files=gs://no-such-bucket-x/*", *SP),
  "hf_no_files": D("{d}/nope", "dataset_type=hf", "hf_path=json", "hf_train_files={d}/nope/*.json", *SP),
  # the data tools
  "to_arrayrecord_no_match": Case("to_arrayrecord", ("--files={d}/nope/*", "--output_dir={d}/ar"), "{d}/nope"),
  "to_arrayrecord_malformed": Case("to_arrayrecord", ("--files={d}/bad.jsonl", "--output_dir={d}/ar"), "bad.jsonl:2"),
  "train_tokenizer_no_match": Case(
    "train_tokenizer", ("--files={d}/nope/*", "--vocab_size=64", "--output_dir={d}/t"), "{d}/nope"
  ),
  "inspect_no_match": Case("inspect", ("dataset_type=text", "dataset_path={d}/nope/*.txt"), "{d}/nope", False),
  # hf_to_maxtext input
  "convert_no_directory": Case("convert", ("--hf_path={d}/nope", *CONVERT), "{d}/nope"),
  "convert_no_config": Case("convert", ("--hf_path={d}/docs", *CONVERT), "config.json"),
  "convert_bad_json": Case("convert", (hf("hf_badjson"), *CONVERT), "config.json"),
  "convert_json_list": Case("convert", (hf("hf_list"), *CONVERT), "config.json"),
  "convert_missing_field": Case("convert", (hf("hf_nofield"), *CONVERT), "hidden_size"),
  "convert_unsupported_type": Case("convert", (hf("hf_bert"), *CONVERT), "model_type"),
  "convert_no_safetensors": Case("convert", (hf("hf_notensors"), *CONVERT), "safetensors"),
  "convert_garbage_safetensors": Case("convert", (hf("hf"), *CONVERT), "model.safetensors"),
  "convert_output_under_file": Case("convert", (hf("hf"), "--output={d}/afile/out"), "--output"),
}
LLAMA = {
  "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
  "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256, "hidden_act": "silu", "rms_norm_eps": 1e-5,
}  # fmt: skip


def _write(path, data) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  mode = "wb" if isinstance(data, bytes) else "w"
  with open(path, mode) as f:
    f.write(data)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, corpus):
  """The files the cases name: broken corpora, tokenizers, HF directories, a run of another architecture."""
  d = str(tmp_path_factory.mktemp("bad"))
  docs = {f"{d}/docs/{i}.txt": f"document {i} " * 20 for i in range(4)}
  files_ = {
    **docs,
    f"{d}/one/0.txt": "the only document " * 10,
    f"{d}/empty/0.txt": "",
    f"{d}/binary.txt": bytes(range(256)) * 4,
    f"{d}/utf16.txt": "some text".encode("utf-16"),
    f"{d}/good.jsonl": '{"text": "a"}\n',
    f"{d}/typed.jsonl": '{"text": 3}\n',
    f"{d}/bad.jsonl": '{"text": "a"}\n{"text": \n',
    f"{d}/list.jsonl": "[1, 2]\n",
    f"{d}/fake.parquet": b"not parquet at all",
    f"{d}/fake.arrayrecord": b"not an array record",
    f"{d}/tok": b"\x00garbage tokenizer",
    f"{d}/afile": "a file where a directory is expected",
    f"{d}/hf/config.json": json.dumps(LLAMA),
    f"{d}/hf/model.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00garbage",
    f"{d}/hf_badjson/config.json": '{"model_type": "llama",',
    f"{d}/hf_list/config.json": "[]",
    f"{d}/hf_nofield/config.json": json.dumps({k: v for k, v in LLAMA.items() if k != "hidden_size"}),
    f"{d}/hf_bert/config.json": json.dumps({**LLAMA, "model_type": "bert"}),
    f"{d}/hf_notensors/config.json": json.dumps(LLAMA),
    # a run saved with emb_dim=128: its config.yml and a step directory are what the check reads
    f"{d}/runs/old/config.yml": "emb_dim: 128\nbase_emb_dim: 128\ndecoder_block: llama2\n",
    f"{d}/runs/old/checkpoints/1/state/placeholder": "",
  }
  for path, data in files_.items():
    _write(path, data)
  _save_params(f"{d}/params128", "base_emb_dim=128")
  shutil.copytree(f"{d}/params128", f"{d}/runs/noyml/checkpoints/1/state")
  return {"d": d, "sp": corpus[1]}


def _save_params(path: str, *overrides: str) -> None:
  """A params-only checkpoint of the TINY model with `overrides`, with no config.yml beside it (zeros)."""
  c = config.load([BASE, *TINY, *overrides], {})
  params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), state.param_spec(c).abstract)
  checkpointing.save_params(path, params)


def _argv(case: Case, scratch: dict) -> list[str]:
  """sys.argv for the case's main: the program name first."""
  args = [a.format(**scratch) for a in case.args]
  if case.entry in OWN_ARGV:
    return [f"{case.entry}.py", *args]
  common = [f"base_output_directory={scratch['d']}/out", "run_name=bad", *TINY, "steps=2"]
  return [f"{case.entry}.py", BASE, *common, *args]


MAINS = {
  "train": train.main,
  "decode": decode.main,
  "inspect": inspect.main,
  "convert": hf_to_maxtext.main,
  "to_arrayrecord": convert_to_arrayrecord.main,
  "train_tokenizer": train_tokenizer.main,
}
OWN_ARGV = ("convert", "to_arrayrecord", "train_tokenizer")  # argparse tools: no config file, only the case's args


# Our own INFO progress lines (launch.setup_logging's format), printed before an error as in any run; whether the
# handler writes into this test's captured stderr depends on which tests ran first in the process, so they are
# left out of the count.
PROGRESS = re.compile(r"\d\d:\d\d:\d\d MaxText\.")


def assert_one_line_exit(outcome: Outcome, names: str) -> None:
  lines = [line for line in outcome.stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
  assert "Traceback" not in outcome.stderr + outcome.stdout, outcome.stderr[-3000:]
  assert outcome.code == 1, outcome
  assert len(lines) == 1, outcome.stderr
  assert names in lines[0], lines[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_with_one_line(name, scratch, monkeypatch):
  monkeypatch.setattr(files, "REMOTE_CHECK_TIMEOUT_S", 1.0)  # no network here: storage never answers
  built = []  # a data error is found once files are opened, but still before the train step is built
  step_fn = train.train_step_fn
  monkeypatch.setattr(train, "train_step_fn", lambda *args: built.append(1) or step_fn(*args))
  case = CASES[name]
  outcome = run_main(MAINS[case.entry], _argv(case, scratch))
  assert_one_line_exit(outcome, case.names.format(**scratch))
  assert not built, f"{name}: the train step was built before the error"
  if case.knowable:
    assert outcome.compiles == 0, f"{name}: {outcome.compiles} compilations before the error"


def test_resuming_with_other_data_exits_with_one_line(scratch, tmp_path):
  """The run's data iterator state does not fit the new corpus: one line, before the train step is built, and the
  run's checkpoint untouched."""
  for name, count in (("a", 4), ("b", 5)):
    for i in range(count):
      _write(f"{tmp_path}/{name}/{i}.txt", f"document {i} of corpus {name} " * 20)
  common = [BASE, f"base_output_directory={tmp_path}/out", "run_name=r", *TINY, *(a.format(**scratch) for a in SP)]
  common += ["dataset_type=text", "enable_checkpointing=true"]
  first = run_main(train.main, ["train.py", *common, "steps=1", f"dataset_path={tmp_path}/a/*.txt"])
  assert first.code == 0, first.stderr[-3000:]
  outcome = run_main(train.main, ["train.py", *common, "steps=2", f"dataset_path={tmp_path}/b/*.txt"])
  assert_one_line_exit(outcome, "rows per epoch")
  assert outcome.compiles == 0 and os.listdir(f"{tmp_path}/out/r/checkpoints") == ["1"]


def test_there_are_at_least_sixty_cases():
  assert len(CASES) >= 60


SUBPROCESS_CASES = ("negative_learning_rate", "kv_heads_over_tensor", "text_no_match", "convert_no_config")


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_real_process_exits_as_in_process(name, scratch):
  """The in-process verdict is the one a user sees: status 1, the same line last on stderr, no traceback."""
  case = CASES[name]
  argv = _argv(case, scratch)[1:]
  script = {"train": "MaxText/train.py", "convert": "MaxText/convert/hf_to_maxtext.py"}[case.entry]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  real = subprocess.run([sys.executable, script, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  inproc = run_main(MAINS[case.entry], _argv(case, scratch))
  assert real.returncode == 1, real.stderr[-3000:]
  assert "Traceback" not in real.stderr + real.stdout, real.stderr[-3000:]
  assert real.stderr.strip().splitlines()[-1] == inproc.stderr.strip(), (real.stderr, inproc.stderr)


def test_compile_counter_sees_compilations():
  """The 'before compilation' assertions mean something: the counter counts a fresh jit."""
  before = _compiles[0]
  jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()
  assert _compiles[0] > before
