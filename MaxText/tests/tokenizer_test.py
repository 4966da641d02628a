"""SentencePiece training and loading (MaxText/data/tokenizer.py)."""

import pathlib

import pytest

from MaxText.data import tokenizer as tokenizers
from MaxText.data import train_tokenizer
from MaxText.tests.helpers import tiktoken_file

CODE = "def f(x):\n    return x + 1\n\n\nclass A:\n    pass\n"
TEXTS = [CODE * 3, "The quick brown fox jumps over the lazy dog.\n" * 5, "héllo wörld, ça va? ✓\n"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  return tokenizers.train_sentencepiece(TEXTS, 400, str(tmp_path_factory.mktemp("tok")))


@pytest.mark.quick
def test_trained_model_ids_and_roundtrip(model_path):
  tok = tokenizers.load_tokenizer(model_path)
  assert model_path.endswith("tokenizer.model")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert 260 < tok.vocab_size <= 400
  for text in [*TEXTS, "unseen: 中文 🙂 \t tabs\r\n", "  leading spaces"]:
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # byte fallback + identity normalisation: lossless
    assert 0 not in ids  # padding never appears in a document


def test_decode_skips_control_ids_and_accepts_arrays(model_path):
  import numpy as np

  tok = tokenizers.load_tokenizer(model_path)
  ids = tok.encode("return x")
  assert tok.decode(np.array([tok.bos_id, *ids, tok.eos_id, 0, 0], np.int32)) == "return x"
  assert tok.encode_batch(["a b", CODE]) == [tok.encode("a b"), tok.encode(CODE)]


def test_training_from_files_is_deterministic(tmp_path, model_path):
  files = []
  for i, text in enumerate(TEXTS):
    files.append(tmp_path / f"{i}.txt")
    files[-1].write_text(text, encoding="utf-8")
  path = tokenizers.train_sentencepiece(files, 400, str(tmp_path / "out"))
  assert pathlib.Path(path).parent == tmp_path / "out"
  # The model file also records its temporary training path, so compare the vocabularies.
  assert _pieces(path) == _pieces(model_path)


def _pieces(path):
  tok = tokenizers.load_tokenizer(path)
  return [tok._sp.id_to_piece(i) for i in range(tok.vocab_size)]


def test_load_errors(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    tokenizers.load_tokenizer(str(tmp_path / "missing.model"))
  (tmp_path / "bad.model").write_text("not a model")
  with pytest.raises(ValueError, match="not a sentencepiece tokenizer"):
    tokenizers.load_tokenizer(str(tmp_path / "bad.model"))


def test_training_errors(tmp_path):
  with pytest.raises(ValueError, match="vocab_size=100"):
    tokenizers.train_sentencepiece(TEXTS, 100, str(tmp_path))
  with pytest.raises(ValueError, match="empty"):
    tokenizers.train_sentencepiece(["", "  \n"], 400, str(tmp_path))


def test_tiktoken_llama3_style(tmp_path):
  tok = tokenizers.load_tokenizer(tiktoken_file(tmp_path / "tokenizer.model"), "tiktoken")
  assert tok.vocab_size == 262 + 256 and (tok.bos_id, tok.eos_id) == (262, 263)
  for text in TEXTS:
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode("the") == [257]
  # Special-token text inside a document is plain text; special ids decode to nothing.
  assert tok.decode([tok.bos_id, *tok.encode("<|eot_id|> the"), tok.eos_id]) == "<|eot_id|> the"
  assert tok.encode_batch(["the", "return"]) == [tok.encode("the"), tok.encode("return")]
  with pytest.raises(ValueError, match="raise vocab_size to at least 518"):
    tokenizers.check_tokenizer(tok, 512, True, True)


def test_huggingface_tokenizer_json(tmp_path):
  import json

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  hf.train_from_iterator(TEXTS, trainer)
  hf.save(str(tmp_path / "tokenizer.json"))
  tok = tokenizers.load_tokenizer(str(tmp_path), "huggingface")  # a directory holding tokenizer.json
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and tok.vocab_size <= 300
  for text in TEXTS:
    assert tok.decode(tok.encode(text)) == text
  assert tok.decode([1, *tok.encode("x = 1"), 2, 0]) == "x = 1"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "</s>"}, "eos_token": "<s>"}))
  tok = tokenizers.load_tokenizer(str(tmp_path / "tokenizer.json"), "huggingface")
  assert (tok.bos_id, tok.eos_id) == (2, 1)
  with pytest.raises(ValueError, match="is not a huggingface tokenizer"):
    tokenizers.load_tokenizer(tiktoken_file(tmp_path / "ranks.model"), "huggingface")


def test_train_command_reads_jsonl(tmp_path):
  import json

  (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
  train_tokenizer.main(
    [
      "train_tokenizer.py",
      "--files",
      str(tmp_path / "*.jsonl"),
      "--vocab_size",
      "400",
      "--output_dir",
      str(tmp_path / "o"),
    ]
  )
  assert _pieces(str(tmp_path / "o" / "tokenizer.model")) == _pieces(
    tokenizers.train_sentencepiece(TEXTS, 400, str(tmp_path))
  )
