"""Plain string rows need no chat template, with any tokenizer: use_sft's {"prompt", "completion"} and the preference
objectives' {"prompt", "chosen", "rejected"} strings become BOS, the prompt's ids, the reply's ids and EOS (the loss on
the reply and EOS), with the SentencePiece tokenizer the quick start trains and a tiktoken one; a conversation
(lists of messages) with either says in one line that it needs a chat template."""

import numpy as np
import pytest

from MaxText import config
from MaxText.data import make_iterators as make_data
from MaxText.errors import DataError
from MaxText.tests.conftest import BASE, TINY, as_numpy, mesh_of
from MaxText.tests.helpers import tiktoken_file, write_jsonl

KINDS = ("sentencepiece", "tiktoken")
PROMPT, REPLY = "Doc 3: alpha beta", " gamma delta."


@pytest.fixture(scope="module")
def tokenizer_paths(corpus, tmp_path_factory):
  """tokenizer_type -> a tokenizer file: conftest's SentencePiece model (512 pieces), a tiny tiktoken file (518)."""
  return {"sentencepiece": corpus[1], "tiktoken": tiktoken_file(tmp_path_factory.mktemp("tiktoken") / "tok.model")}


def load(tmp_path, tokenizer_paths, kind, records, *overrides):
  data = write_jsonl(tmp_path / "rows.jsonl", records)
  tok = [f"tokenizer_type={kind}", f"tokenizer_path={tokenizer_paths[kind]}", "vocab_size=640"]
  args = [BASE, "run_name=plain", f"base_output_directory={tmp_path}", *TINY, "dataset_type=text", *tok]
  c = config.load([*args, f"dataset_path={data}", "eval_fraction=0", "packing=false", *overrides], {})
  its = make_data(c, mesh_of(c, 1))
  return as_numpy(next(its.train)), its.tokenizer


def segment(batch, s, row=0):
  """(the segment's tokens, its tokens that carry loss, i.e. targets whose targets_segmentation is s)."""
  return batch["inputs"][row][batch["inputs_segmentation"][row] == s], batch["targets"][row][
    batch["targets_segmentation"][row] == s
  ]


@pytest.mark.parametrize("kind", KINDS)
def test_sft_prompt_and_completion_strings_are_plain_text(tmp_path, tokenizer_paths, kind):
  b, tok = load(tmp_path, tokenizer_paths, kind, [{"prompt": PROMPT, "completion": REPLY}], "use_sft=true")
  tokens, trained = segment(b, 1)
  assert tokens.tolist() == [tok.bos_id, *tok.encode(PROMPT), *tok.encode(REPLY), tok.eos_id]
  assert trained.tolist() == [*tok.encode(REPLY), tok.eos_id]  # the loss: the reply and EOS, not the prompt
  b, _ = load(tmp_path, tokenizer_paths, kind, [{"prompt": PROMPT, "completion": REPLY}], "use_sft=true",
              "add_bos=false", "add_eos=false", "sft_train_on_completion_only=false")  # fmt: skip
  tokens, trained = segment(b, 1)
  assert tokens.tolist() == [*tok.encode(PROMPT), *tok.encode(REPLY)] and trained.tolist() == tokens[1:].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_preference_strings_are_plain_text(tmp_path, tokenizer_paths, kind):
  pair = {"prompt": PROMPT, "chosen": REPLY, "rejected": " zeta."}
  b, tok = load(tmp_path, tokenizer_paths, kind, [pair], "objective=dpo", "max_target_length=64")
  for s, reply in ((1, REPLY), (2, " zeta.")):  # pair 1: chosen is segment 1, rejected segment 2
    tokens, trained = segment(b, s)
    assert tokens.tolist() == [tok.bos_id, *tok.encode(PROMPT), *tok.encode(reply), tok.eos_id]
    assert trained.tolist() == [*tok.encode(reply), tok.eos_id]


@pytest.mark.parametrize(
  "records, objective",
  [
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}], "use_sft=true"),
    ([{"prompt": [{"role": "user", "content": "hi"}], "completion": "yo"}], "use_sft=true"),
    ([{"prompt": "hi", "chosen": [{"role": "assistant", "content": "yo"}], "rejected": "no"}], "objective=simpo"),
  ],
)
def test_a_conversation_without_a_chat_template_is_one_line(tmp_path, tokenizer_paths, records, objective):
  with pytest.raises(DataError, match=r"rows.jsonl:1.* is a conversation .* needs a chat template") as e:
    load(tmp_path, tokenizer_paths, "sentencepiece", records, objective)
  assert "\n" not in str(e.value) and "tokenizer_type=huggingface" in str(e.value)


def test_plain_rows_decode_to_the_text(tmp_path, tokenizer_paths):
  b, tok = load(tmp_path, tokenizer_paths, "sentencepiece", [{"prompt": PROMPT, "completion": REPLY}], "use_sft=true")
  tokens, trained = segment(b, 1)
  assert tok.decode(tokens) == PROMPT + REPLY and tok.decode(trained) == REPLY
  assert np.all(b["inputs_position"][0][: len(tokens)] == np.arange(len(tokens)))
