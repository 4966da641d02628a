"""Supervised fine-tuning (use_sft=true): chat templates render as transformers renders them, prompt tokens carry
no loss, packing keeps examples whole in their own segments, a tiny model learns a fixed reply, and bad examples
or settings fail with one line."""

import os

import jax
import numpy as np
import pytest

from MaxText import config, train
from MaxText.data import chat, sft
from MaxText.data import make_iterators as make_data
from MaxText.errors import ConfigError, DataError
from MaxText.tests.conftest import as_numpy, check_batch, losses, mesh_of
from MaxText.tests.helpers import CHATML, make_tokenizer, sft_config, write_jsonl

CONVERSATION = [
  {"role": "system", "content": "You are terse."},
  {"role": "user", "content": "What is the capital of France?"},
  {"role": "assistant", "content": "Paris."},
  {"role": "user", "content": "And of Italy?"},
  {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.mark.torch
def test_rendering_and_tokens_match_transformers_apply_chat_template(tok):
  import transformers

  hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(tok.path))
  template = chat.load_template(tok)
  for gen in (False, True):
    ours = template.render(CONVERSATION, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen)
  ex = chat.tokenize(template, tok, chat.Conversation(CONVERSATION, 0), True, "test")
  expected = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
  expected = expected["input_ids"] if isinstance(expected, dict) else list(expected)
  assert ex.tokens.tolist() == expected
  # The completion is exactly the two replies with their end-of-turn tokens.
  completion = tok.decode(ex.tokens[ex.loss_mask == 1])
  assert completion.replace("\n", "") == "Paris.Rome."
  assert tok.decode(ex.tokens[ex.loss_mask == 0]).count("France") == 1


def test_generation_markers_and_the_default_template(tmp_path, tok):
  marked = CHATML.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\\n' }}",
  )
  template = chat.ChatTemplate(marked, {}, "test")
  text, spans = chat.completion_spans(template, chat.Conversation(CONVERSATION, 0), "test")
  assert text == chat.load_template(tok).render(CONVERSATION)
  assert [text[a:b] for a, b in spans] == ["Paris.<|im_end|>", "Rome.<|im_end|>"]
  plain = make_tokenizer(str(tmp_path / "plain"), template=None, eos="</s>")
  default = chat.load_template(plain)
  messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
  assert default.render(messages) == "<s>User: Hi\nAssistant: Hello</s>"
  assert default.render(messages[:1], add_generation_prompt=True) == "<s>User: Hi\nAssistant: "
  _, spans = chat.completion_spans(default, chat.Conversation(messages, 0), "test")
  assert [default.render(messages)[a:b] for a, b in spans] == ["Hello</s>"]


def test_prompt_completion_columns_train_only_the_completion(tmp_path, tok):
  columns = chat.Columns("messages", "prompt", "completion")
  conv = chat.conversation({"prompt": "What is the capital of France?", "completion": "Paris."}, columns, "r")
  assert [m["role"] for m in conv.messages] == ["user", "assistant"] and conv.first_trained == 1
  few_shot = {"prompt": CONVERSATION[:3] + CONVERSATION[3:4], "completion": CONVERSATION[4:]}
  ex = chat.tokenize(chat.load_template(tok), tok, chat.conversation(few_shot, columns, "r"), True, "r")
  assert tok.decode(ex.tokens[ex.loss_mask == 1]).strip() == "Rome."  # the in-prompt reply carries no loss


@pytest.mark.quick
def test_batches_put_loss_on_completion_tokens_only_and_pack_whole_examples(tmp_path, tok):
  records = [
    {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]} for i in range(6)
  ]
  c = sft_config(
    tmp_path, tok, write_jsonl(tmp_path / "chat.jsonl", records), "max_target_length=64", "per_device_batch_size=1"
  )
  mesh = mesh_of(c, 1)
  b = check_batch(next(make_data(c, mesh).train), c, mesh, 1)
  template = chat.load_template(tok)
  segments = np.unique(b["inputs_segmentation"][0][b["inputs_segmentation"][0] > 0])
  assert len(segments) >= 2  # several examples share the row, each its own segment from position 0
  for seg in segments:
    where = b["inputs_segmentation"][0] == seg
    ids = b["inputs"][0][where]
    np.testing.assert_array_equal(b["inputs_position"][0][where], np.arange(len(ids)))
    text = tok.decode(ids)
    number = text.split("Q")[1].split("?")[0]
    conv = chat.Conversation(records[int(number)]["messages"], 0)
    ex = chat.tokenize(template, tok, conv, True, "t")
    np.testing.assert_array_equal(ids, ex.tokens)  # whole, never split across rows
    # A target carries loss exactly when the token it predicts is in the completion.
    np.testing.assert_array_equal(b["targets_segmentation"][0][where][:-1] != 0, ex.loss_mask[1:] == 1)
    trained = b["targets"][0][where][b["targets_segmentation"][0][where] != 0]
    assert tok.decode(trained).strip() == f"A{number}.<|im_end|>".replace("<|im_end|>", "")
  from MaxText.data import inspect

  assert "    loss on 5 tokens: 'A" in "\n".join(inspect.describe_row(b, 0, tok))  # A, 3, ., <|im_end|>, newline
  everything = c.replace(sft_train_on_completion_only=False)
  seg = as_numpy(next(make_data(everything, mesh).train))["targets_segmentation"][0]
  inputs_seg = b["inputs_segmentation"][0]  # the same rows: the mask does not change the packing
  # Every token but the last of each example is a target.
  assert (seg != 0).sum() == (inputs_seg != 0).sum() - len(np.unique(inputs_seg[inputs_seg != 0]))


def test_rows_resume_and_reshuffle_per_epoch():
  lengths = [3, 5, 2, 7, 4, 1, 6]
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  ex = sft.Examples(np.arange(1, offsets[-1] + 1, dtype=np.int32), np.ones(offsets[-1], np.uint8), offsets)
  rows = sft.ExampleRows(ex, 8, packing=True, seed=3)
  r = rows.rows_per_epoch
  tokens = rows.rows(np.arange(2 * r))[0]
  assert sorted(t for t in tokens[:r].ravel() if t) == list(range(1, offsets[-1] + 1))  # every token once per epoch
  assert sorted(map(tuple, tokens[:r])) == sorted(map(tuple, tokens[r:]))  # the same rows, in a new order
  assert rows.next_row(rows.state(r + 2)) == r + 2
  unpacked = sft.ExampleRows(ex, 4, packing=False, seed=None)
  assert unpacked.rows_per_epoch == len(lengths) and (unpacked.rows(np.array([3]))[1] == 1).all()  # truncated to 4


@pytest.mark.parametrize(
  "record, match",
  [
    ({"text": "hello"}, r"has neither a 'messages' column nor 'prompt' and 'completion'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, r"message 0 has role 'robot'; roles are system, user"),
    ({"messages": [{"role": "assistant", "content": 3}]}, r"int content"),
  ],
)
def test_bad_examples_fail_with_one_line_naming_the_line(tmp_path, tok, record, match):
  good = {"prompt": "a", "completion": "b"}
  c = sft_config(tmp_path, tok, write_jsonl(tmp_path / "bad.jsonl", [good, record]))
  with pytest.raises(DataError, match=match) as e:
    make_data(c, mesh_of(c, 1))
  assert "bad.jsonl:2" in str(e.value) and "\n" not in str(e.value)


def test_bad_settings_fail_at_load(tmp_path, tok):
  data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
  with pytest.raises(ConfigError, match="sft_chat_template needs tokenizer_type=huggingface"):
    sft_config(tmp_path, tok, data, "tokenizer_type=sentencepiece", "sft_chat_template=chat.jinja")
  with pytest.raises(ConfigError, match="dataset_type=text with dataset_path"):
    sft_config(tmp_path, tok, data, "dataset_type=synthetic")
  with pytest.raises(ConfigError, match="sft_chat_template='nope.jinja' does not exist"):
    sft_config(tmp_path, tok, data, "sft_chat_template=nope.jinja")


def test_a_tiny_model_learns_a_fixed_reply_then_greedy_decode_gives_it(tmp_path, tok):
  questions = ("What is the capital of France?", "Hello there", "how are you today?", "What is it?")
  records = [{"prompt": q, "completion": "Paris."} for q in questions]
  data = write_jsonl(tmp_path / "fixed.jsonl", records)
  overrides = ("steps=20", "max_target_length=64", "per_device_batch_size=4", "learning_rate=3e-3")
  c = sft_config(tmp_path, tok, data, *overrides).replace(enable_checkpointing=True, checkpoint_period=20)
  train.run(c, jax.devices()[:1])
  assert losses(c)[-1] < 0.05, losses(c)
  from MaxText import decode

  prompt = chat.load_template(tok).render([{"role": "user", "content": "What is it?"}], add_generation_prompt=True)
  params = train.checkpoint_path(c, 20)
  d = c.replace(load_parameters_path=params, prompt=prompt, add_bos=False, decode_max_new_tokens=8)
  assert decode.run(d, rows=1).texts[0].strip() == "Paris."


def test_parquet_files_and_hf_datasets_give_the_same_examples(tmp_path, tok, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # local files only: never the network
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  import pyarrow as pa
  import pyarrow.parquet as pq

  records = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}]
  pq.write_table(pa.Table.from_pylist(records), str(tmp_path / "chat.parquet"))
  jsonl = write_jsonl(tmp_path / "chat.jsonl", records)
  template = chat.load_template(tok)
  from_parquet = sft.load_examples(
    sft_config(tmp_path, tok, tmp_path / "chat.parquet", "max_target_length=128"), tok, template
  )[0]
  hf = sft_config(
    tmp_path, tok, jsonl, "dataset_type=hf", "hf_path=json", f"hf_train_files={jsonl}", "max_target_length=128"
  )
  from_hf = sft.load_examples(hf, tok, template)[0]
  for a, b in zip(from_parquet, from_hf):
    np.testing.assert_array_equal(a, b)
  assert len(from_hf.offsets) == 3 and from_hf.loss_mask.sum() > 0


def test_the_cpu_sft_recipe_loads_with_the_paths_it_asks_for(tmp_path, tok):
  data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
  paths = [f"tokenizer_path={tok.path}", f"dataset_path={data}", f"base_output_directory={tmp_path}"]
  c = config.load(["cpu/sft", *paths], {})
  assert c.use_sft and c.decoder_block == "llama2" and c.run_name == "sft"
  with pytest.raises(ConfigError, match="tokenizer_path"):
    config.load(["cpu/sft", f"dataset_path={data}"], {})


def test_a_template_that_raises_names_the_example(tmp_path):
  strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
  tok = make_tokenizer(str(tmp_path / "strict"), template=strict + CHATML)
  c = sft_config(tmp_path, tok, write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}]))
  with pytest.raises(DataError, match=r"d.jsonl:1: The chat template refused the conversation: first message must"):
    make_data(c, mesh_of(c, 1))


def test_eval_holds_out_examples_and_runs_one_epoch(tmp_path, tok):
  records = [{"prompt": f"Q{i}?", "completion": f"A{i}."} for i in range(6)]
  data = write_jsonl(tmp_path / "d.jsonl", records)
  overrides = ("eval_fraction=0.5", "eval_interval=5", "eval_steps=-1", "per_device_batch_size=1", "packing=false")
  c = sft_config(tmp_path, tok, data, *overrides)
  iterators = make_data(c, mesh_of(c, 1))
  held = list(map(as_numpy, iterators.eval_factory()))
  assert len(held) == 3  # one example per row, 3 of the 6 held out, then the epoch ends
  train_rows = [as_numpy(next(iterators.train)) for _ in range(3)]
  seen = {tok.decode(b["inputs"][0]) for b in train_rows}
  assert not seen & {tok.decode(b["inputs"][0]) for b in held}
  assert all((b["targets_segmentation"] != 0).sum() == 5 for b in held)  # A, digit, ., <|im_end|>, newline
