"""What a bad input is told: a file given as a checkpoint directory, a jsonl text field that is not a string, a
preference pair with a null side, a reply that is a list of non-messages. One line each, saying what is wrong."""

import json

import pytest

from MaxText import config
from MaxText.data import files, preferences
from MaxText.errors import ConfigError, DataError
from MaxText.tests.conftest import BASE


@pytest.mark.parametrize("key", ["load_parameters_path", "load_full_state_path"])
def test_a_file_given_as_a_checkpoint_is_named_a_file_at_load(tmp_path, key):
  saved = tmp_path / "config.yml"
  saved.write_text("steps: 3\n")
  said = rf"^{key}='.*config.yml' is a file, not a checkpoint directory; give <run dir>/checkpoints/<step>/state"
  with pytest.raises(ConfigError, match=said):
    config.load([BASE, "run_name=t", f"{key}={saved}"], {})  # at load: before any tokenizer is trained


@pytest.mark.parametrize(
  "value, said",
  [
    (0, r"0 \(of type int\)"),
    (None, "null"),
    (["a"], r"\['a'\] \(of type list\)"),
  ],
)
def test_a_text_field_that_is_no_string_says_so(tmp_path, value, said):
  path = tmp_path / "a.jsonl"
  path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
  with pytest.raises(DataError, match=rf"^{path}:2: its text field 'text' is {said}, not a string$"):
    files.jsonl_column(str(path), "text", "set text_column")


@pytest.mark.parametrize("side", ["chosen", "rejected"])
def test_a_null_side_of_a_pair_is_named(side):
  record = {"prompt": "1+1=", "chosen": "2", "rejected": "3"} | {side: None}
  with pytest.raises(DataError, match=rf"^p.jsonl:1: '{side}' is null; a pair needs a reply in both"):
    preferences.sides(record, "p.jsonl:1")
  with pytest.raises(DataError, match=r"^p.jsonl:1 is not a preference pair \(it has 'prompt', 'chosen'\)"):
    preferences.sides({"prompt": "1+1=", "chosen": "2"}, "p.jsonl:1")  # a missing side: as before


def test_a_reply_of_non_messages_says_what_it_must_be():
  record = {"prompt": "1+1=", "chosen": [1, 2], "rejected": "3"}
  match = (
    r"^p.jsonl:1: 'chosen' must be a string or a non-empty list of \{'role', 'content'\} messages; its item 0 is 1,"
  )
  with pytest.raises(DataError, match=match):
    preferences.sides(record, "p.jsonl:1")
  conversation = {"chosen": ["hi"], "rejected": [{"role": "user", "content": "x"}]}
  with pytest.raises(DataError, match=r"'chosen' must be a non-empty list of .* its item 0 is 'hi', not a message$"):
    preferences.sides(conversation, "p.jsonl:1")
