"""Vision-language fine-tuning data and LoRA: images from a Hugging Face dataset's Image column (Parquet written by
`datasets`, a save_to_disk directory, one image or a list per row, a custom sft_images_column) give the same
examples and pixels as the image files named by path; bad image rows fail in one line naming the row; LoRA trains
text adapters only with the tower frozen, and tower/projector adapters too with freeze_vision_encoder=false,
whose merge and export fold them in."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import checkpointing, optimizers, sharding
from MaxText import state as state_lib
from MaxText import train_step as steps
from MaxText.data import chat, image_records, sft
from MaxText.errors import ConfigError, DataError
from MaxText.layers import lora
from MaxText.tests.conftest import cfg, hf_offline
from MaxText.tests.helpers import (
  LORA,
  host_tree,
  leaf_names,
  learnable_batch,
  leaves_equal,
  make_tokenizer,
  sft_config,
  write_jsonl,
)

datasets = pytest.importorskip("datasets")
Image = pytest.importorskip("PIL.Image")

MM = ["decoder_block=gemma3", "base_num_decoder_layers=2", "use_multimodal=true", "image_size_for_vit=16"]
MM += ["patch_size_for_vit=4", "hidden_size_for_vit=16", "intermediate_size_for_vit=24", "mm_tokens_per_image=4"]
MM += ["num_hidden_layers_for_vit=1", "num_attention_heads_for_vit=2", "image_token_id=310"]
MM += ["image_start_token_id=311", "image_end_token_id=312", "images_per_row=2", "max_target_length=64"]
IMAGE = 310
TOWER = ("query", "key", "value", "out", "fc1", "fc2")  # the SigLIP layer's projections


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
  hf_offline(monkeypatch)


def _messages(i):
  return [{"role": "user", "content": f"What is in picture {i}?"}, {"role": "assistant", "content": "A cat."}]


def _features(**images):
  """A conversation column and the image column(s) given."""
  message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
  return datasets.Features({"messages": [message], **images})


def _pictures(tmp_path, n=3):
  """n random RGB images of odd sizes, as PIL images and as PNG files."""
  rng = np.random.default_rng(0)
  pictures, files = [], []
  for i in range(n):
    picture = Image.fromarray(rng.integers(0, 256, (20 + i, 24, 3)).astype(np.uint8))
    files.append(str(tmp_path / f"p{i}.png"))
    picture.save(files[-1])
    pictures.append(picture)
  return pictures, files


def _examples(c, tok):
  """(tokens, loss mask, pixels [rows, images_per_row, S, S, 3]) of every example, one per row."""
  ex = sft.load_examples(c, tok, chat.load_template(tok))[0]
  rows = sft.ExampleRows(ex, c.max_target_length, False, None)
  tokens, _, _, mask, pixels = rows.rows(np.arange(rows.rows_per_epoch))
  return tokens, mask, pixels


def test_hf_image_columns_give_the_examples_of_the_image_files(tmp_path, tok):
  pictures, files = _pictures(tmp_path)
  per_row = [[0], [1, 2], []]
  many = datasets.Dataset.from_dict(
    {"messages": [_messages(i) for i in range(3)], "pics": [[pictures[k] for k in ks] for ks in per_row]},
    features=_features(pics=datasets.List(datasets.Image())),
  )
  many.to_parquet(str(tmp_path / "many.parquet"))
  many.save_to_disk(str(tmp_path / "saved"))
  common = [*MM, "sft_images_column=pics"]
  by_path = write_jsonl(tmp_path / "paths.jsonl", [{"messages": _messages(i), "pics": [files[k] for k in ks]}
                                                   for i, ks in enumerate(per_row)])  # fmt: skip
  want = _examples(sft_config(tmp_path, tok, by_path, *common), tok)
  assert want[0].tolist().count([]) == 0 and (want[0] == IMAGE).sum() == 3 * 4  # 3 images x 4 soft tokens
  assert np.abs(want[2][1, 1]).sum() > 0 and not want[2][2].any()  # row 1's second image; row 2 has none
  parquet = str(tmp_path / "many.parquet")
  sources = {
    "parquet, dataset_type=hf": ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={parquet}"],
    "save_to_disk": ["dataset_type=hf", f"hf_path={tmp_path / 'saved'}"],
    "parquet, dataset_type=text": [],  # the {bytes, path} structs read by pyarrow
  }
  for name, extra in sources.items():
    got = _examples(sft_config(tmp_path, tok, parquet, *common, *extra), tok)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_array_equal(a, b, err_msg=name)
  # One Image per row (not a list), under the default column name "images".
  one = datasets.Dataset.from_dict(
    {"messages": [_messages(i) for i in range(2)], "images": pictures[:2]},
    features=_features(images=datasets.Image()),
  )
  one.to_parquet(str(tmp_path / "one.parquet"))
  got = _examples(sft_config(tmp_path, tok, "x", *MM, "dataset_type=hf", "hf_path=parquet",
                             f"hf_train_files={tmp_path / 'one.parquet'}"), tok)  # fmt: skip
  np.testing.assert_array_equal(got[2][:, 0], want[2][:2, 0])
  assert not got[2][:, 1].any()


def test_a_saved_dataset_dict_serves_its_splits(tmp_path, tok):
  """hf_path=<a DatasetDict.save_to_disk directory>: train_split and hf_eval_split; a split it lacks, or an eval
  split of a saved Dataset (no splits), fails in one line."""
  pictures, _ = _pictures(tmp_path, 2)
  features = _features(images=datasets.List(datasets.Image()))
  split = {
    name: datasets.Dataset.from_dict({"messages": [_messages(i)], "images": [[pictures[i]]]}, features=features)
    for i, name in enumerate(("train", "validation"))
  }
  datasets.DatasetDict(split).save_to_disk(str(tmp_path / "dict"))
  c = sft_config(tmp_path, tok, "x", *MM, "dataset_type=hf", f"hf_path={tmp_path / 'dict'}", "hf_eval_split=validation")
  train, held = sft.load_examples(c, tok, chat.load_template(tok))
  assert [w for w, _ in train.images] == [f"hf_path={str(tmp_path / 'dict')!r} split 'train' row 0"]
  rows = sft.ExampleRows(held, c.max_target_length, False, None).rows(np.array([0]))
  np.testing.assert_array_equal(rows[-1][0, 0], image_records.pixels(pictures[1], 16, ""))
  with pytest.raises(DataError, match=r"the saved DatasetDict has splits \['train', 'validation'\], not 'test'$"):
    sft.load_examples(c.replace(hf_eval_split="test"), tok, chat.load_template(tok))
  split["train"].save_to_disk(str(tmp_path / "one"))
  with pytest.raises(DataError, match="a saved Dataset has no splits; save a DatasetDict with a 'validation' split"):
    sft.load_examples(c.replace(hf_path=str(tmp_path / "one")), tok, chat.load_template(tok))


def test_hf_image_rows_are_read_when_their_batch_is_built(tmp_path):
  """Loading keeps references to the memory-mapped rows, not decoded (or encoded) images."""
  pictures, _ = _pictures(tmp_path, 2)
  features = datasets.Features({"text": datasets.Value("string"), "images": datasets.List(datasets.Image())})
  data = datasets.Dataset.from_dict({"text": ["a", "b"], "images": [[pictures[0]], pictures]}, features=features)
  rest, refs = image_records.split_hf_images(data, "images")
  assert rest.column_names == ["text"] and [len(r) for r in refs] == [1, 2]
  assert all(isinstance(r, image_records.HfImage) for row in refs for r in row)
  want = (np.asarray(pictures[1].resize((8, 8), Image.Resampling.BILINEAR), np.float32) - 127.5) / 127.5
  np.testing.assert_array_equal(image_records.pixels(refs[1][1], 8, "row 1"), want)
  assert image_records.split_hf_images(data, "other")[1] is None  # no such column: nothing to split
  paths = datasets.Dataset.from_dict({"images": [["a.png"]]})
  assert image_records.split_hf_images(paths, "images")[1] is None  # paths stay in the records


@pytest.mark.parametrize(
  "column, extra, match",
  [
    ({"bytes": b"not a png", "path": "x.png"}, [], r"image 'x.png' \(hf_path='parquet' split 'train' row 1\) is not"),
    ({"bytes": b"GIF89a", "path": None}, [], r"image <6 bytes> \(.*row 1\) is not a readable image"),
    ("null", [], r"row 1: one of its images is null"),
    (None, ["images_per_row=1"], r"row 0 has 2 images, more than images_per_row=1"),
    (None, ["use_multimodal=false"], r"image\(s\) \(.*row 0\) for a text-only model"),
  ],
)  # fmt: skip
def test_bad_hf_image_rows_fail_in_one_line_naming_the_row(tmp_path, tok, column, extra, match):
  pictures, _ = _pictures(tmp_path, 2)
  second = pictures[1] if column is None else None if column == "null" else column  # row 1 holds [second]
  data = datasets.Dataset.from_dict(
    {"messages": [_messages(0), _messages(1)], "images": [[pictures[0], pictures[1]], [second]]},
    features=_features(images=datasets.List(datasets.Image())),
  )
  data.to_parquet(str(tmp_path / "bad.parquet"))
  args = ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={tmp_path / 'bad.parquet'}", *extra]
  with pytest.raises(DataError, match=match) as e:
    _examples(sft_config(tmp_path, tok, "x", *MM, *args), tok)
  assert "\n" not in str(e.value)


def test_a_value_that_is_no_image_fails_naming_the_row(tmp_path, tok):
  data = write_jsonl(tmp_path / "bad.jsonl", [{"messages": _messages(0), "images": [7]}])
  with pytest.raises(DataError, match=r"bad.jsonl:1: 'images' must hold an image path, .* got 7$"):
    _examples(sft_config(tmp_path, tok, data, *MM), tok)
  data = write_jsonl(tmp_path / "big.jsonl", [{"messages": _messages(0), "images": {"bytes": None, "path": None}}])
  with pytest.raises(DataError, match=r"big.jsonl:1: 'images' must hold"):
    _examples(sft_config(tmp_path, tok, data, *MM), tok)


def _mm_batch(c, rows=1):
  """A learnable batch (each target its input + 1) of `rows` rows with two images each, each image a block of
  4 placeholders that its soft tokens fill."""
  batch = {k: v[:rows] for k, v in learnable_batch(c).items()}
  batch["inputs"][:, 1:5], batch["inputs"][:, 9:13] = IMAGE, IMAGE
  batch["images"] = np.random.default_rng(1).uniform(-1, 1, (rows, 2, 16, 16, 3)).astype(np.float32)
  return batch


def _lora(tmp_path, freeze, *extra):
  """A tiny gemma3 with its tower under LoRA, on one device (compiles faster than over eight)."""
  c = cfg(tmp_path, "l", *MM, *LORA, "lora_random_base=true", "vocab_size=320", "ici_fsdp_parallelism=1",
          f"freeze_vision_encoder={str(freeze).lower()}", *extra)  # fmt: skip
  mesh = sharding.create_mesh(c, jax.devices()[:1])
  optimizer = optimizers.build(c)
  with sharding.activate(c, mesh):
    spec = state_lib.state_spec(c, optimizer.tx, mesh)
  return c, mesh, optimizer, spec


@pytest.mark.slow  # about 25 s of CPU: init, a train step, two forwards and two exports compile
def test_lora_trains_tower_adapters_and_merge_and_export_fold_them_in(tmp_path):
  """freeze_vision_encoder=false: adapters on the tower's projections and the projector too; two steps move
  every adapter and nothing else (the base, tower included, stays bit-identical). The merged params (no LoRA)
  give the adapted model's logits with images, and maxtext_to_hf with lora_weights_path writes what exporting
  the merged params writes, tower included."""
  safetensors = pytest.importorskip("safetensors.numpy")
  from MaxText.convert import maxtext_to_hf  # noqa: PLC0415

  c, mesh, optimizer, spec = _lora(tmp_path, False, "use_post_attn_norm=true", "use_post_ffw_norm=true")
  with sharding.activate(c, mesh):
    state = state_lib.init_state(c, optimizer.tx, spec)
  before = host_tree(spec.partition.split(state.params))
  tower = {n for n in leaf_names(before.trainable) if "vision_encoder" in n}
  assert {n.split("]")[-3] for n in tower if "layers" in n} == {f"['{m}'" for m in TOWER}
  assert any("mm_input_projection" in n for n in tower) and not any("patch_embedding" in n for n in tower)
  step_fn = steps.jit_train_step(c, mesh, optimizer.tx, spec, optimizer.schedule)
  batch = _mm_batch(c)
  with sharding.activate(c, mesh):
    for i in range(2):  # B starts at 0, so A moves from the second step on
      state, metrics = step_fn(state, jax.device_put(batch, steps.batch_shardings(c, mesh)), jax.random.key(i))
      assert np.isfinite(float(metrics["loss"]))
  adapters, base = host_tree(spec.partition.split(state.params))
  assert all(leaves_equal(before.frozen, base))
  assert not any(leaves_equal(before.trainable, adapters))
  merged = lora.merged(c, spec.partition.combine(adapters, base))
  query = [t["vision_encoder"]["layers"]["query"]["kernel"][...] for t in (merged, base)]
  assert not np.array_equal(*query)  # the tower's adapters were folded in
  tokens, images = jnp.asarray(batch["inputs"]), jnp.asarray(batch["images"])
  positions, segments = jnp.asarray(batch["inputs_position"]), jnp.ones_like(tokens)
  plain_spec = state_lib.param_spec(c.replace(lora_rank=0), mesh)
  adapted, folded = (
    np.asarray(jax.jit(lambda p, g=g: nnx.merge(g, p)(tokens, positions, segments, images=images))(p))
    for g, p in ((spec.graphdef, spec.partition.combine(adapters, base)), (plain_spec.graphdef, merged))
  )
  np.testing.assert_allclose(folded, adapted, atol=2e-5, rtol=2e-5)
  paths = {name: os.path.join(tmp_path, name) for name in ("base", "adapters", "merged")}
  for name, tree in (("base", base), ("adapters", adapters), ("merged", merged)):
    checkpointing.save_params(paths[name], tree)
  exported = c.replace(load_parameters_path=paths["base"], lora_weights_path=paths["adapters"])
  maxtext_to_hf.convert(exported, os.path.join(tmp_path, "hf_lora"))
  maxtext_to_hf.convert(c.replace(lora_rank=0, load_parameters_path=paths["merged"]), os.path.join(tmp_path, "hf"))
  seen = set()
  for name in sorted(os.listdir(os.path.join(tmp_path, "hf"))):
    if name.endswith(".safetensors"):
      want, got = (safetensors.load_file(os.path.join(tmp_path, d, name)) for d in ("hf", "hf_lora"))
      assert want.keys() == got.keys()
      seen |= set(want)
      for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)
  assert any("vision_tower" in k and "q_proj" in k for k in seen)


def test_a_frozen_tower_gets_no_adapters_and_bad_tower_targets_fail_at_startup(tmp_path):
  """freeze_vision_encoder=true (default) under LoRA: adapters in the text layers only, so nothing of the tower
  or projector is trainable (and the decoder stops its gradient); its targets then go unused."""
  spec = state_lib.param_spec(cfg(tmp_path, "f", *MM, "lora_rank=4", "lora_vision_target_modules=fc3"))
  adapters, base = spec.partition.split(spec.abstract)
  assert adapters and not any("vision_encoder" in n for n in leaf_names(adapters))
  assert any("vision_encoder" in n for n in leaf_names(base))
  with pytest.raises(ConfigError, match="lora_vision_target_modules='fc3' matches no projection of the vision") as e:
    state_lib.param_spec(cfg(tmp_path, "r", *MM, "lora_rank=4", "freeze_vision_encoder=false",
                             "lora_vision_target_modules=fc3"))  # fmt: skip
  assert "\n" not in str(e.value) and "layers/0/query" in str(e.value)
  with pytest.raises(ConfigError, match=r"lora_vision_target_modules='\(' is not a regular expression"):
    cfg(tmp_path, "x", *MM, "lora_vision_target_modules=(")


def test_flops_of_an_adapted_tower_count_its_forward_and_activation_backward(tmp_path):
  """Under LoRA a trained tower has no weight gradients: 2x its forward, not 3x; its adapters are not counted
  per text token."""
  from MaxText import flops  # noqa: PLC0415

  count = {
    freeze: flops.training_flops_per_token(cfg(tmp_path, "f", *MM, "lora_rank=4", f"freeze_vision_encoder={freeze}"))
    for freeze in ("true", "false")
  }
  assert count["false"].vision == 2 * count["true"].vision > 0
  assert count["false"].total - count["false"].vision == count["true"].total - count["true"].vision


def test_tower_targets_pick_layers_when_unrolled_and_all_or_none_when_scanned(tmp_path):
  """Names carry the layer index in both layouts (layers/<i>/query); unrolled layers are adapted one by one, a
  scanned stack in every layer or in none (a pattern picking some of them is a one-line error at startup)."""
  one = (
    "lora_rank=4",
    "freeze_vision_encoder=false",
    "lora_vision_target_modules=layers/1/query",
    "num_hidden_layers_for_vit=2",
  )
  spec = state_lib.param_spec(cfg(tmp_path, "u", *MM, *one, "scan_layers=false"))
  adapters = [n for n in leaf_names(spec.partition.split(spec.abstract)[0]) if "vision_encoder" in n]
  assert adapters and all("['layers'][1]['query']" in n for n in adapters), adapters
  with pytest.raises(ConfigError, match=r"matches layers/1/query in 1 of \d+ vision layers; scanned layers are"):
    state_lib.param_spec(cfg(tmp_path, "s", *MM, *one, "scan_layers=true"))
