"""Input pipeline (MaxText/data): synthetic and text backends, packing, resume, errors."""

import json
import logging
import os

import numpy as np
import pytest

from MaxText import config
from MaxText import data as data_package
from MaxText.data import files, make_iterators, text
from MaxText.data import tokenizer as tokenizers
from MaxText.data.batches import process_rows
from MaxText.data.packing import DocumentRows
from MaxText.errors import ConfigError
from MaxText.tests.conftest import (
  DOCS,
  as_numpy,
  assert_same_batches,
  check_batch,
  cpu_subprocess_env,
  data_argv,
  data_config,
  decoded_segments,
  mesh_of,
  take_batches,
  text_config,
)
from MaxText.tests.helpers import two_process_overrides


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.quick
def test_synthetic_batches(tmp_path, devices):
  cfg = data_config(tmp_path, "dataset_type=synthetic", "per_device_batch_size=2", "eval_per_device_batch_size=1")
  mesh = mesh_of(cfg, devices)
  its = make_iterators(cfg, mesh)
  assert its.tokenizer is None
  b = check_batch(next(its.train), cfg, mesh, 2 * devices)
  assert ((b["inputs"] >= 1) & (b["inputs"] < cfg.vocab_size)).all()
  assert (b["inputs_segmentation"] == 1).all() and (b["inputs_position"] == np.arange(32)).all()
  assert (b["targets_segmentation"][:, :-1] == 1).all()
  e = check_batch(next(its.eval_factory()), cfg, mesh, devices)
  assert not np.array_equal(e["inputs"], b["inputs"][:devices])


def test_synthetic_batch_does_not_depend_on_the_mesh(tmp_path):
  one = data_config(tmp_path, "dataset_type=synthetic", "per_device_batch_size=8")
  eight = data_config(tmp_path, "dataset_type=synthetic", "per_device_batch_size=1")
  expected = take_batches(make_iterators(one, mesh_of(one, 1)).train, 2)
  assert_same_batches(take_batches(make_iterators(eight, mesh_of(eight, 8)).train, 2), expected)


def test_synthetic_resume(tmp_path):
  cfg = data_config(tmp_path, "dataset_type=synthetic")
  mesh = mesh_of(cfg, 8)
  train = make_iterators(cfg, mesh).train
  take_batches(train, 3)
  state = json.loads(json.dumps(train.get_state()))  # as a checkpoint stores it
  assert state == {"step": 3}
  expected = take_batches(train, 2)
  resumed = make_iterators(cfg, mesh).train
  resumed.set_state(state)
  assert_same_batches(take_batches(resumed, 2), expected)


@pytest.mark.parametrize("devices", [1, 8])
def test_text_batches(tmp_path, corpus, devices):
  cfg = text_config(tmp_path, corpus, "eval_fraction=0.2", "eval_per_device_batch_size=2")
  mesh = mesh_of(cfg, devices)
  its = make_iterators(cfg, mesh)
  assert its.tokenizer.vocab_size <= cfg.vocab_size
  check_batch(next(its.train), cfg, mesh, devices)
  check_batch(next(its.eval_factory()), cfg, mesh, 2 * devices)


@pytest.mark.quick
def test_text_packing_keeps_documents_and_masks_their_ends(tmp_path, corpus):
  cfg = text_config(tmp_path, corpus)
  its = make_iterators(cfg, mesh_of(cfg, 8))
  batches = take_batches(its.train, 4)
  pieces = [p for b in batches for p in decoded_segments(b, its.tokenizer)]
  assert all(any(piece in doc for doc in DOCS) for piece, *_ in pieces)
  assert max(np.max(b["inputs_segmentation"]) for b in batches) >= 3  # several documents share a row
  assert its.tokenizer.bos_id in [first for _, first, _, _ in pieces]
  assert its.tokenizer.eos_id in [last for _, _, last, _ in pieces]
  assert not any(has_target for *_, has_target in pieces)  # no target across documents or rows


def test_text_without_packing_one_document_per_row(tmp_path, corpus):
  cfg = text_config(tmp_path, corpus, "packing=false", "max_target_length=64")
  its = make_iterators(cfg, mesh_of(cfg, 8))
  b = take_batches(its.train, 1)[0]
  seg = b["inputs_segmentation"]
  assert set(np.unique(seg)) <= {0, 1} and (seg == 0).any()
  assert (np.diff(seg, axis=1) <= 0).all()  # the document, then only padding
  for piece, first, last, _ in decoded_segments(b, its.tokenizer):
    assert first == its.tokenizer.bos_id
    # Short documents fit whole (BOS .. EOS); long ones are truncated to their start.
    assert piece in DOCS if last == its.tokenizer.eos_id else any(d.startswith(piece) for d in DOCS)


def test_packed_epochs_cover_every_token_once_and_reshuffle():
  lengths = np.array([5, 1, 9, 3, 7])
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  tokens = np.arange(1, offsets[-1] + 1)
  rows = DocumentRows(tokens, offsets, np.arange(5), length=4, packing=True, seed=0)
  assert rows.rows_per_epoch == 7  # ceil(25 / 4)
  epochs = []
  for epoch in range(3):
    toks, seg, _ = rows.rows(np.arange(epoch * 7, epoch * 7 + 7))
    epochs.append(toks[seg > 0])
    assert sorted(epochs[-1]) == list(tokens)
  assert not np.array_equal(epochs[0], epochs[1])


def test_text_resume_across_epochs(tmp_path, corpus):
  cfg = text_config(tmp_path, corpus)
  mesh = mesh_of(cfg, 8)
  train = make_iterators(cfg, mesh).train
  rows_per_epoch = train.get_state()["rows_per_epoch"]
  take_batches(train, -(-rows_per_epoch // 8))  # into the second epoch
  state = json.loads(json.dumps(train.get_state()))
  assert state["epoch"] == 1 and state["row"] < 8
  expected = take_batches(train, 3)
  resumed = make_iterators(cfg, mesh).train
  resumed.set_state(state)
  assert_same_batches(take_batches(resumed, 3), expected)
  with pytest.raises(ValueError, match="cannot\\s+resume exactly"):
    resumed.set_state({**state, "rows_per_epoch": rows_per_epoch + 1})


def test_eval_split_is_disjoint_and_restarts(tmp_path, corpus):
  cfg = text_config(tmp_path, corpus, "eval_fraction=0.25", "packing=false", "max_target_length=128")
  docs = text.list_documents(cfg)
  names = text.document_names(docs, np.ones(len(DOCS), np.int64))
  train_ids, eval_ids = text.split_documents(docs, names, np.ones(len(DOCS), bool), cfg.eval_fraction)
  assert len(eval_ids) == 3 and not set(train_ids) & set(eval_ids)
  its = make_iterators(cfg, mesh_of(cfg, 8))
  first, again = next(its.eval_factory()), next(its.eval_factory())
  assert_same_batches([as_numpy(first)], [as_numpy(again)])
  eval_texts = {its.tokenizer.decode(row) for row in np.asarray(first["inputs"])}
  assert eval_texts == {DOCS[i] for i in eval_ids}  # 8 rows cycle over the 3 eval documents
  assert its.sample_prompt == " ".join(DOCS[eval_ids[0]].split()[:6])  # the summary's decode prompt: held out
  assert make_iterators(text_config(tmp_path, corpus), mesh_of(cfg, 8)).eval_factory is None


def test_tokenizer_is_trained_once_and_cached(tmp_path, corpus, monkeypatch):
  cfg = data_config(tmp_path, "dataset_type=text", f"dataset_path={corpus[0]}")
  mesh = mesh_of(cfg, 1)
  first = make_iterators(cfg, mesh)
  assert first.tokenizer.path == os.path.join(cfg.tokenizer_dir, "tokenizer.model")
  assert any(f.startswith("corpus-") for f in os.listdir(cfg.tokenizer_dir))

  def fail(*args, **kwargs):
    raise AssertionError("the cached tokenizer should be reused")

  monkeypatch.setattr(tokenizers, "train_sentencepiece", fail)
  monkeypatch.setattr(text, "tokenize_documents", fail)  # the tokens are cached too
  assert_same_batches(take_batches(make_iterators(cfg, mesh).train, 2), take_batches(first.train, 2))


def test_vocab_smaller_than_tokenizer_is_an_error(tmp_path, corpus):
  cfg = text_config(tmp_path, corpus, "vocab_size=300")
  with pytest.raises(ValueError, match="raise vocab_size to at least"):
    make_iterators(cfg, mesh_of(cfg, 1))


def test_corpus_errors(tmp_path, corpus):
  cfg = text_config(tmp_path, corpus, f"dataset_path={tmp_path}/nothing/**/*.txt")
  with pytest.raises(ValueError, match="matches no files"):
    make_iterators(cfg, mesh_of(cfg, 1))
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "a.txt").write_text("")
  (tmp_path / "empty" / "b.txt").write_text(" \n\n")
  cfg = text_config(tmp_path, corpus, f"dataset_path={tmp_path}/empty/*.txt")
  with pytest.raises(ValueError, match="corpus is empty"):
    make_iterators(cfg, mesh_of(cfg, 1))
  (tmp_path / "empty" / "c.txt").write_bytes(b"caf\xe9")
  with pytest.raises(ValueError, match="Cannot decode document .*c.txt"):
    make_iterators(cfg, mesh_of(cfg, 1))


def _write_jsonl_and_parquet(root, column="text"):
  """DOCS split over a .jsonl file (first half, with a blank line) and a .parquet file (second half)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  half = len(DOCS) // 2
  lines = [json.dumps({column: d, "id": i}) for i, d in enumerate(DOCS[:half])]
  (root / "a.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
  pq.write_table(pa.table({column: DOCS[half:], "id": list(range(half, len(DOCS)))}), root / "b.parquet")
  return f"{root}/*"


def test_text_jsonl_and_parquet_documents(tmp_path, corpus):
  (tmp_path / "mixed").mkdir()
  glob = _write_jsonl_and_parquet(tmp_path / "mixed", column="body")
  cfg = text_config(tmp_path, corpus, f"dataset_path={glob}", "text_column=body", "packing=false")
  cfg = cfg.replace(max_target_length=128, eval_fraction=0.25, eval_steps=-1)
  its = make_iterators(cfg, mesh_of(cfg, 4))
  train = {its.tokenizer.decode(r) for b in take_batches(its.train, 3) for r in b["inputs"]}
  evals = [its.tokenizer.decode(r) for b in its.eval_factory() for r in np.asarray(b["inputs"])]
  assert len(evals) == 4 and evals[-1] == ""  # one epoch of 3 held-out documents, the last row padding
  assert train | set(evals[:3]) == set(DOCS) and not train & set(evals)
  bad = text_config(tmp_path, corpus, f"dataset_path={glob}")  # the files have no "text" field
  with pytest.raises(ValueError, match="a.jsonl:1 has no text field 'text'"):
    make_iterators(bad, mesh_of(bad, 1))
  (tmp_path / "mixed" / "c.parquet").write_text("not parquet")
  bad = text_config(tmp_path, corpus, f"dataset_path={tmp_path}/mixed/c.parquet")
  with pytest.raises(ValueError, match="Cannot read Parquet file .*c.parquet"):
    make_iterators(bad, mesh_of(bad, 1))


def test_tokenizer_path_must_exist(tmp_path, corpus):
  with pytest.raises(ConfigError, match="tokenizer_path=.*missing.model.* does not exist"):
    text_config(tmp_path, corpus, f"tokenizer_path={tmp_path}/missing.model")


def test_process_rows_follow_the_sharding():
  class Sharding:  # what a process holding devices for rows 4-5 and 0-1 of 8 sees
    def addressable_devices_indices_map(self, shape):
      return {"d0": (slice(4, 6), slice(None)), "d1": (slice(0, 2), slice(None))}

  assert list(process_rows(Sharding(), (8, 16))) == [0, 1, 4, 5]


def test_two_processes_build_the_single_process_batches(tmp_path, corpus):
  import socket
  import subprocess
  import sys

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  from MaxText.data.convert_to_arrayrecord import write_arrayrecord

  write_arrayrecord(DOCS, str(tmp_path / "records"), num_shards=3)
  # The tokenizer is trained (by process 0 only) in the processes' shared run directory.
  argv = data_argv(tmp_path, f"dataset_path={corpus[0]}")
  env = cpu_subprocess_env(4)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  code = "import sys; from MaxText.tests.helpers import data_process_main as m; m(int(sys.argv[1]), *sys.argv[2:])"
  procs = [
    subprocess.Popen([sys.executable, "-c", code, str(p), str(port), str(tmp_path), *argv], env=env, cwd=root)
    for p in range(2)
  ]
  try:
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
  finally:
    for p in procs:
      p.kill()  # only if one hung: the other would wait for it forever
  shards = {**np.load(tmp_path / "0.npz"), **np.load(tmp_path / "1.npz")}
  model = os.path.join(tmp_path, "t", "tokenizer", "tokenizer.model")
  got = lambda name, step: np.concatenate([shards[f"{name}/{step}/{row}"] for row in range(8)])  # noqa: E731
  for dataset_type in ("text", "synthetic", "grain"):
    cfg = config.load([*argv, *two_process_overrides(dataset_type, str(tmp_path)), f"tokenizer_path={model}"], {})
    expected = take_batches(make_iterators(cfg, mesh_of(cfg, 8)).train, 3)
    if dataset_type == "grain":  # elastic resume: the same global batches on another number of processes
      one = make_iterators(cfg, mesh_of(cfg, 8)).train
      one.set_state(json.loads((tmp_path / "grain_state.json").read_text()))  # two shards, both read here
      for step, batch in enumerate(take_batches(one, 2), 3):
        np.testing.assert_array_equal(batch["inputs"], got("grain", step))
      for step in range(3):  # two processes read the one shard of a one-process state
        np.testing.assert_array_equal(got("grain1", step), expected[step]["inputs"])
    for step in range(3):
      if dataset_type != "grain":
        np.testing.assert_array_equal(got(dataset_type, step), expected[step]["inputs"])
        continue
      # grain: process p reads records p, p + 2, ... of the global order: disjoint halves of the same batch.
      two = got("grain", step)
      assert not {tuple(r) for r in two[:4]} & {tuple(r) for r in two[4:]}
      assert sorted(map(tuple, two)) == sorted(map(tuple, expected[step]["inputs"]))


def test_inspect_prints_decoded_segments(tmp_path, corpus, capsys):
  from MaxText.data import inspect

  glob, model = corpus
  inspect.main(
    ["inspect.py", *data_argv(tmp_path, f"dataset_path={glob}", f"tokenizer_path={model}"), "num_batches=2", "rows=8"]
  )
  out = capsys.readouterr().out
  assert "=== batch 1: (8, 32) int32" in out and "row 7:" in out and "batch 2" not in out
  assert "segment 2:" in out and "from position 0 BOS" in out and "has a target" not in out
  assert any(line.startswith("    | Doc ") for line in out.splitlines())


def data_import_graph() -> dict[str, set[str]]:
  """MaxText.data module -> the MaxText.data modules it imports anywhere: top level, inside functions and
  under TYPE_CHECKING. `from MaxText.data import x` is an edge to the submodule x when there is one (the
  package itself is initialised first for any submodule, so that is no edge of its own)."""
  import ast
  import pathlib

  root = pathlib.Path(data_package.__file__).parent
  modules = {"MaxText.data" + ("" if p.stem == "__init__" else f".{p.stem}"): p for p in root.glob("*.py")}
  graph = {}
  for name, path in modules.items():
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        edges.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
        module = ".".join(filter(None, (base, node.module)))
        edges.update(f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names)
    graph[name] = {e for e in edges if e in modules and e != name}
  return graph


def test_data_package_imports_have_no_cycle():
  import graphlib

  graph = data_import_graph()
  assert {"MaxText.data.text", "MaxText.data.tokenizer", "MaxText.data.files"} <= set(graph)
  assert "MaxText.data.files" in graph["MaxText.data.text"]  # the parser sees `from MaxText.data import files`
  try:
    graphlib.TopologicalSorter(graph).prepare()
  except graphlib.CycleError as e:
    pytest.fail(f"MaxText/data has an import cycle: {' -> '.join(e.args[1])}")


def _logged(fn, *loggers):
  """fn()'s result and the messages `loggers` logged meanwhile (the MaxText logger does not propagate to caplog)."""
  messages = []
  handler = logging.Handler(logging.INFO)
  handler.emit = lambda record: messages.append((record.levelno, record.getMessage()))
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as launch.setup_logging sets it for the entry points
  try:
    return fn(), messages
  finally:
    for logger, level in zip(loggers, levels):
      logger.removeHandler(handler)
      logger.setLevel(level)


def test_undecodable_files_of_a_lenient_corpus_are_one_count_line(tmp_path, corpus):
  """The stdlib corpus skips the test suite's deliberately undecodable files: one line, not one per file."""
  for name, data in (("a.py", b"x = 1\n"), ("b.py", b"# -*- coding: nope -*-\n"), ("c.txt", b"caf\xe9")):
    (tmp_path / name).write_bytes(data)
  docs = text.Documents([str(tmp_path / n) for n in ("a.py", "b.py", "c.txt")], str(tmp_path), strict=False)
  texts, said = _logged(lambda: text.read_all(text_config(tmp_path, corpus), docs), text.log, files.log)
  assert texts.texts == ["x = 1\n", "", ""]
  assert said == [(logging.INFO, "Skipped 2 files that do not decode as text (e.g. b.py)")]


def test_a_corpus_smaller_than_one_batch_is_warned_of(tmp_path, corpus):
  (tmp_path / "tiny").mkdir()
  (tmp_path / "tiny" / "a.txt").write_text("hi")
  cfg = text_config(tmp_path, corpus, f"dataset_path={tmp_path}/tiny/*.txt")
  _, said = _logged(lambda: make_iterators(cfg, mesh_of(cfg, 2)), text.log)  # 2 rows per step, 1 in the corpus
  warnings = [m for level, m in said if level == logging.WARNING]
  assert len(warnings) == 1 and "1 document of 4 tokens" in warnings[0] and "one step's 2 rows" in warnings[0]
  _, said = _logged(lambda: make_iterators(cfg, mesh_of(cfg, 1)), text.log)  # it fills a one-row batch
  assert not [m for level, m in said if level == logging.WARNING]
