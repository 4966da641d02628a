"""Direct preference optimisation (objective=dpo; use_dpo=true is its alias): pairs become rows of chosen/rejected
segments, the first step's loss is ln 2, 8 devices (fsdp, tensor) and gradient accumulation give the 1-device
losses, a resume is exact, LoRA holds no reference copy, a tiny model learns to prefer correct sums, and bad pairs
fail with one line."""

import json
import math

import jax
import numpy as np
import optax
import pytest

from MaxText import config, train
from MaxText import state as state_lib
from MaxText.data import chat, preferences, sft
from MaxText.data import make_iterators as make_data
from MaxText.errors import ConfigError, DataError
from MaxText.objectives import dpo
from MaxText.tests.conftest import BASE, TINY, as_numpy, hf_offline, mesh_of
from MaxText.tests.helpers import make_tokenizer, write_jsonl

LN2 = math.log(2.0)
CONVERSATION = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return make_tokenizer(str(tmp_path_factory.mktemp("tok")), template=None)  # no template: strings are plain text


def sums(wrong=(1,), numbers=range(5)):
  """'a+b=' prompts, chosen the correct sum, rejected (sum + w) mod 10 for each w of `wrong` (one digit, like
  every chosen one: the pair differs in its first completion token)."""
  return [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str((a + b + w) % 10)}
    for a in numbers
    for b in numbers
    for w in wrong
  ]


def dpo_config(tmp_path, tok, data, *overrides, name="dpo"):
  args = [BASE, f"run_name={name}", f"base_output_directory={tmp_path}", *TINY, "dataset_type=text", "use_dpo=true"]
  tok_args = ["tokenizer_type=huggingface", f"tokenizer_path={tok.path}", "vocab_size=320", "max_target_length=64"]
  return config.load([*args, f"dataset_path={data}", *tok_args, "eval_fraction=0", *overrides], {})


def records(c):
  with open(c.metrics_file) as f:
    return [json.loads(line) for line in f]


def test_rows_hold_whole_pairs_with_the_loss_on_completions(tmp_path, tok):
  messages = [{"role": "user", "content": "2+2="}]
  reply = lambda answer: [*messages, {"role": "assistant", "content": answer}]  # noqa: E731
  pairs = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"chosen": reply("4"), "rejected": reply("5")}]
  data = write_jsonl(tmp_path / "p.jsonl", pairs)
  c = dpo_config(tmp_path, tok, data, "per_device_batch_size=1", "max_target_length=128")
  b = as_numpy(next(make_data(c, mesh_of(c, 1)).train))
  template = chat.load_template(tok)
  seg, target_seg, pos = b["inputs_segmentation"][0], b["targets_segmentation"][0], b["inputs_position"][0]
  assert set(np.unique(seg)) == {0, 1, 2, 3, 4}  # packed: two pairs, chosen odd, rejected even
  for s in (1, 2, 3, 4):
    where = seg == s
    np.testing.assert_array_equal(pos[where], np.arange(where.sum()))  # each side its own sequence
    completion = tok.decode(b["targets"][0][target_seg == s].tolist())  # the answer and the end of turn
    assert completion.startswith(("2", "4") if s % 2 else ("3", "5")), (s, completion)
  # Strings without a chat template are plain text; the conversation is rendered with the default template.
  expected = {(tok.bos_id, *tok.encode("1+1="), *tok.encode(a), tok.eos_id) for a in "23"}
  expected |= {tuple(tok.encode_with_offsets(template.render(reply(a)))[0]) for a in "45"}
  assert {tuple(b["inputs"][0][seg == s].tolist()) for s in (1, 2, 3, 4)} == expected


def test_parquet_and_jsonl_pairs_give_the_same_examples(tmp_path, tok):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pairs = sums((1, 2)) + [
    {"chosen": CONVERSATION, "rejected": CONVERSATION[:1] + [{"role": "assistant", "content": "4"}]}
  ]
  pq.write_table(pa.Table.from_pylist(pairs[:-1]), str(tmp_path / "p.parquet"))
  template = chat.load_template(tok)
  from_parquet = sft.load_examples(
    dpo_config(tmp_path, tok, tmp_path / "p.parquet"), tok, template, preferences.encode_pairs
  )
  c = dpo_config(tmp_path, tok, write_jsonl(tmp_path / "p.jsonl", pairs))
  from_jsonl = sft.load_examples(c, tok, template, preferences.encode_pairs)[0]
  n = len(pairs) - 1
  for a, b in zip(
    from_parquet[0], (from_jsonl.tokens[: from_jsonl.offsets[n]], from_jsonl.loss_mask[: from_jsonl.offsets[n]])
  ):
    np.testing.assert_array_equal(a, b)
  assert len(from_jsonl.offsets) == len(pairs) + 1


@pytest.mark.quick
def test_pair_logps_sum_each_segment_and_the_loss_is_ln2_at_equal_models():
  token_logps = np.log(np.array([[0.5, 0.5, 0.25, 0.1, 0.2, 1.0]], np.float32))
  segments = np.array([[0, 1, 1, 2, 0, 0]], np.int32)
  pairs = dpo.pair_logps(token_logps, segments)
  np.testing.assert_allclose(pairs.logps[0, 0], [np.log(0.5 * 0.25), np.log(0.1)], rtol=1e-6)
  np.testing.assert_array_equal(pairs.tokens[0, 0], [2, 1])
  assert float(pairs.tokens[0, 1:].sum()) == 0
  c = config.load([BASE, *TINY, "dpo_label_smoothing=0.2"], {})
  loss, aux = dpo.loss_sums(c, pairs, pairs)
  np.testing.assert_allclose(float(loss), LN2, rtol=1e-6)
  assert float(aux["pairs"]) == 1 and float(aux["tokens"]) == 3
  ipo = c.replace(dpo_loss="ipo", dpo_beta=0.5)
  np.testing.assert_allclose(float(dpo.loss_sums(ipo, pairs, pairs)[0]), 1.0, rtol=1e-6)  # (0 - 1/(2 beta))^2


SIX = ("learning_rate_schedule_steps=6", "learning_rate=3e-3", "max_target_length=96")


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, tok):
  """The 1-device reference run: 6 steps of 8 pairs, packing, the learning-rate schedule fixed at 6 steps."""
  tmp = tmp_path_factory.mktemp("six")
  data = write_jsonl(tmp / "p.jsonl", sums((1, 2)))
  c = dpo_config(tmp, tok, data, *SIX, "steps=6", "per_device_batch_size=8")
  train.run(c, jax.devices()[:1])
  return data, records(c)


def test_first_step_loss_is_ln2_and_the_metrics_are_logged(six_steps):
  first, last = six_steps[1][0], six_steps[1][-1]
  assert abs(first["loss"] - LN2) < 1e-5, first["loss"]
  assert abs(first["dpo_reward_margin"]) < 1e-5 and first["dpo_accuracy"] == 0 and first["dpo_pairs"] >= 8
  assert {"dpo_chosen_reward", "dpo_rejected_reward"} <= set(first) and "perplexity" not in first
  assert last["dpo_reward_margin"] > 0 and last["loss"] < LN2


@pytest.mark.slow
def test_8_devices_and_gradient_accumulation_give_the_1_device_losses(six_steps, tmp_path, tok):
  data, reference = six_steps
  mesh = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "gradient_accumulation_steps=2")
  c = dpo_config(tmp_path, tok, data, *SIX, *mesh, "steps=3", "per_device_batch_size=1")
  train.run(c, jax.devices()[:8])
  np.testing.assert_allclose([r["loss"] for r in records(c)], [r["loss"] for r in reference[:3]], rtol=2e-5)


@pytest.mark.slow
def test_resume_3_plus_3_steps_equals_6_steps(six_steps, tmp_path, tok):
  data, reference = six_steps
  c = dpo_config(tmp_path, tok, data, *SIX, "steps=3", "per_device_batch_size=8", "enable_checkpointing=true")
  train.run(c, jax.devices()[:1])
  train.run(c.replace(steps=6), jax.devices()[:1])
  resumed = records(c)
  assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in reference], rtol=1e-6)


@pytest.mark.slow
def test_lora_dpo_holds_no_reference_copy(tmp_path, tok):
  data = write_jsonl(tmp_path / "p.jsonl", sums())
  c = dpo_config(tmp_path, tok, data, "lora_rank=4", "lora_random_base=true", "steps=3", "per_device_batch_size=2")
  plain = c.replace(lora_rank=0)
  assert state_lib.keeps_reference(plain) and not state_lib.keeps_reference(c)
  spec = state_lib.state_spec(c, optax.sgd(0.1), mesh_of(c, 1))
  assert spec.abstract.reference is None and spec.shardings.reference is None
  train.run(c, jax.devices()[:1])
  first, last = records(c)[0], records(c)[-1]
  assert abs(first["loss"] - LN2) < 1e-5
  assert abs(last["dpo_reward_margin"]) > 1e-3  # the reference stayed the base while the adapters trained


@pytest.mark.slow
def test_a_tiny_model_learns_to_prefer_correct_sums_on_held_out_pairs(tmp_path, tok, monkeypatch):
  hf_offline(monkeypatch)  # local files only
  # a, b in 0..2 (sums 0..4) against every wrong digit: 81 pairs. Held out: the 22 whose wrong digit is 5..9 and
  # a + b + wrong is even; each such prompt and each such digit still appears in training, never together.
  pairs = sums(range(1, 10), range(3))
  held = [p for p in pairs if int(p["rejected"]) >= 5 and (int(p["chosen"]) + int(p["rejected"])) % 2 == 0]
  train_file = write_jsonl(tmp_path / "train.jsonl", [p for p in pairs if p not in held])
  held_file = write_jsonl(tmp_path / "held.jsonl", held)
  c = dpo_config(
    tmp_path, tok, train_file, "dataset_type=hf", "hf_path=json", f"hf_train_files={train_file}",
    f"hf_eval_files={held_file}", "eval_interval=60", "eval_steps=-1", "steps=60", "per_device_batch_size=8",
    "dpo_beta=0.5", "log_period=10",
  )  # fmt: skip
  train.run(c, jax.devices()[:1])
  result = [r for r in records(c) if "eval_dpo_accuracy" in r][-1]
  assert result["eval_dpo_pairs"] == len(held) and result["eval_dpo_accuracy"] > 0.9, result
  assert result["eval_dpo_reward_margin"] > 1.0


@pytest.mark.parametrize(
  "record, match",
  [
    ({"prompt": "1+1=", "chosen": "2"}, r"p.jsonl:1 is not a preference pair \(it has 'prompt', 'chosen'\)"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": " "}, r"p.jsonl:1: the 'rejected' completion is empty"),
    ({"chosen": CONVERSATION, "rejected": []}, r"p.jsonl:1: 'rejected' must be a non-empty"),
    ({"chosen": CONVERSATION, "rejected": CONVERSATION}, r"p.jsonl:1: 'chosen' and 'rejected' are the same"),
    ({"chosen": CONVERSATION[:1], "rejected": CONVERSATION}, r"p.jsonl:1 has no assistant turn"),
  ],
)
def test_bad_pairs_fail_with_one_line_naming_the_row(tmp_path, tok, record, match):
  c = dpo_config(tmp_path, tok, write_jsonl(tmp_path / "p.jsonl", [record]))
  with pytest.raises(DataError, match=match) as e:
    make_data(c, mesh_of(c, 1))
  assert "\n" not in str(e.value)


def test_bad_settings_fail_at_load(tmp_path, tok):
  data = write_jsonl(tmp_path / "p.jsonl", sums())
  with pytest.raises(ConfigError, match="dpo_beta=0.0 must be > 0"):
    dpo_config(tmp_path, tok, data, "dpo_beta=0")
  with pytest.raises(ConfigError, match="dpo_label_smoothing=0.5 must be in"):
    dpo_config(tmp_path, tok, data, "dpo_label_smoothing=0.5")
  with pytest.raises(ConfigError, match="dpo_loss='kto' is not one of"):
    dpo_config(tmp_path, tok, data, "dpo_loss=kto")
  with pytest.raises(ConfigError, match="objective=dpo and use_sft=true"):
    dpo_config(tmp_path, tok, data, "use_sft=true")
  with pytest.raises(ConfigError, match="objective=dpo reads dataset_type=text"):
    dpo_config(tmp_path, tok, data, "dataset_type=synthetic")


def test_long_pairs_are_cut_to_fit_the_longer_side_first():
  assert preferences._fit(10, 20, 64) == (10, 20)
  assert preferences._fit(10, 60, 64) == (10, 54)
  assert preferences._fit(50, 60, 64) == (32, 32)
