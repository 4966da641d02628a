"""Llama 4 images in the data path, the Engine and decode.py (data/images.py's tiled scheme), against
transformers: Llama4ImageProcessor's tiles and pixels, Llama4Processor's token layout (1x1, 1x2, 2x1, 2x2 grids),
Gemma3ImageProcessor's pixels; a tiny Llama4ForConditionalGeneration fed by HF's processor vs ours fed by our
pipeline (logits, and greedy tokens through the Engine's KV cache); SFT rows with images packed by tiles."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from MaxText import config, decode
from MaxText.convert import hf_to_maxtext
from MaxText.data import images as images_lib
from MaxText.errors import ConfigError, DataError
from MaxText.inference import Engine
from MaxText.tests import helpers
from MaxText.tests.conftest import HAS_TORCH
from MaxText.tests.helpers import L4V_IMAGE_TOKEN, load_converted, make_tokenizer

if HAS_TORCH:  # the `torch`-marked tests' live references
  import transformers


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """Our directory converted from the committed tiny Llama4ForConditionalGeneration (hf_references/vision/)."""
  tmp = tmp_path_factory.mktemp("l4v")
  _, hf_path = helpers.vision_reference("llama4-vision", tmp)
  hf_to_maxtext.convert(hf_path, os.path.join(tmp, "mt"), scan_layers=True)
  return os.path.join(tmp, "mt")


S, MAX_TILES = 16, 4  # the tiny tower's 16 px tiles (4 px patches -> 4 soft tokens per tile), at most 2 x 2
# The tiny tokenizer's ids (the tiny model's vocabulary is 64; 63 is its image_token_index, <|patch|>)
VOCAB, SPECIAL = helpers.L4V_VOCAB, helpers.L4V_SPECIAL
IDS = [f"image_start_token_id={SPECIAL['<|image_start|>']}", f"image_end_token_id={SPECIAL['<|image_end|>']}"]
IDS += [f"tile_x_separator_token_id={SPECIAL['<|tile_x_separator|>']}", f"max_image_tiles={MAX_TILES}"]
IDS += [f"tile_y_separator_token_id={SPECIAL['<|tile_y_separator|>']}", f"image_global_token_id={SPECIAL['<|image|>']}"]


def tiny_config(**overrides):
  cfg = dict(decoder_block="llama4", image_size_for_vit=S, patch_size_for_vit=4, pixel_shuffle_ratio_for_vit=0.5)
  cfg |= dict(max_image_tiles=MAX_TILES, image_token_id=L4V_IMAGE_TOKEN, use_multimodal=True)
  for arg in IDS:
    key, value = arg.split("=")
    cfg[key] = int(value)
  return types.SimpleNamespace(**(cfg | overrides))


def picture(height, width, seed=0):
  """A smooth uint8 RGB image (photo-like: resizers agree on most pixels)."""
  return helpers.picture(height, width, seed, "smooth")


def assert_committed(case, want):
  """The committed tiles of a helpers.PROCESSED case (image_processors_test compares ours with them) are the
  live processor's: current."""
  assert case in helpers.PROCESSED
  np.testing.assert_array_equal(helpers.committed_processed()[helpers.processed_key(case)], want)


def hf_image_processor(size=S, max_patches=MAX_TILES):
  return transformers.Llama4ImageProcessor(size={"height": size, "width": size}, max_patches=max_patches)


TILE_CASES = [
  ((16, 16), (16, 16), 4, (1, 1)),  # one tile, no global tile
  ((16, 32), (16, 16), 4, (1, 2)),
  ((32, 16), (16, 16), 4, (2, 1)),
  ((7, 30), (16, 16), 4, (1, 2)),  # upscaled to the tile size only, padded
  ((20, 13), (16, 16), 4, (2, 1)),  # downscaled
  ((33, 17), (16, 16), 4, (2, 2)),  # the least upscaling (x 0.94 on 2 x 1 would downscale)
  ((50, 50), (16, 16), 4, (2, 2)),
  ((300, 500), (336, 336), 16, (1, 2)),  # Scout's processor
  ((1000, 800), (336, 336), 16, (3, 3)),
]


@pytest.mark.parametrize("size, shape, max_patches, grid", TILE_CASES)
def test_best_grid_is_the_least_resizing_one(size, shape, max_patches, grid):
  """The processor's grids (checked live below): the one needing the least resizing, upscaling preferred."""
  assert images_lib.best_grid(*size, max_patches, shape[0]) == grid
  c = tiny_config(image_size_for_vit=shape[0], max_image_tiles=max_patches)
  tiles = images_lib.prepare(Image.fromarray(picture(*size)), c).tiles
  assert tiles.shape == (images_lib.num_tiles(grid), *shape, 3)


@pytest.mark.parametrize("size, shape, max_patches, grid", TILE_CASES)
@pytest.mark.torch
def test_llama4_tiles_match_the_image_processor(size, shape, max_patches, grid):
  image = Image.fromarray(picture(*size))
  ref = hf_image_processor(shape[0], max_patches)(image, return_tensors="pt")
  want = ref["pixel_values"].float().numpy().transpose(0, 2, 3, 1)
  c = tiny_config(image_size_for_vit=shape[0], max_image_tiles=max_patches)
  got = images_lib.prepare(image, c)
  assert images_lib.best_grid(*size, max_patches, shape[0]) == grid == tuple(ref["aspect_ratios"][0].tolist())
  assert got.tiles.shape == want.shape == (images_lib.num_tiles(grid), *shape, 3)
  np.testing.assert_array_equal(got.tiles, want)  # torchvision's resize (data/resize.py), bfloat16 normalisation
  if shape[0] == S:
    assert_committed(("llama4", S, max_patches, *size, 0, "smooth"), want)


@pytest.mark.torch
def test_transparency_is_composited_onto_white_as_the_processors_do():
  rgba = np.concatenate([picture(16, 32), np.tile(np.arange(0, 256, 8, dtype=np.uint8), (16, 1))[..., None]], -1)
  image = Image.fromarray(rgba)  # alpha from 0 (left) to 248 (right)
  want = hf_image_processor()(image, return_tensors="pt")["pixel_values"].float().numpy().transpose(0, 2, 3, 1)
  np.testing.assert_array_equal(images_lib.prepare(image, tiny_config()).tiles, want)
  assert_committed(("llama4", S, MAX_TILES, 16, 32, 0, "smooth-alpha"), want)
  c = types.SimpleNamespace(decoder_block="gemma3", image_size_for_vit=32, mm_tokens_per_image=4)
  c.image_start_token_id, c.image_token_id, c.image_end_token_id = 1, 2, 3
  kwargs = dict(size={"height": 32, "width": 32}, do_pan_and_scan=False)
  tv = transformers.Gemma3ImageProcessor(**kwargs)(image, return_tensors="pt")["pixel_values"][0].numpy()
  np.testing.assert_array_equal(images_lib.prepare(rgba, c).tiles[0], tv.transpose(1, 2, 0))
  assert_committed(("gemma3", 32, 0, 16, 32, 0, "smooth-alpha"), tv.transpose(1, 2, 0)[None])


@pytest.mark.parametrize("size", [(16, 16), (20, 13), (40, 64)])
@pytest.mark.torch
def test_gemma3_pixels_match_the_image_processors(size):
  image = Image.fromarray(picture(*size, seed=1))
  c = types.SimpleNamespace(decoder_block="gemma3", image_size_for_vit=S, mm_tokens_per_image=4)
  c.image_start_token_id, c.image_token_id, c.image_end_token_id = 1, 2, 3
  ours = images_lib.prepare(image, c).tiles[0]
  kwargs = dict(size={"height": S, "width": S}, do_pan_and_scan=False)
  tv = transformers.Gemma3ImageProcessor(**kwargs)(image, return_tensors="pt")["pixel_values"][0].numpy()
  np.testing.assert_array_equal(ours, tv.transpose(1, 2, 0))  # the default (torchvision) processor: exact
  assert_committed(("gemma3", S, 0, *size, 1, "smooth"), tv.transpose(1, 2, 0)[None])
  pil = transformers.Gemma3ImageProcessorPil(**kwargs)(image, return_tensors="np")["pixel_values"][0]
  diff = np.abs(ours - pil.transpose(1, 2, 0))  # Pillow's resize (the "pil" backend): one level of 255
  assert diff.max() <= 2 / 255 + 1e-6


@pytest.mark.parametrize("sizes", helpers.L4V_LAYOUTS, ids=helpers.l4v_layout_key)
@pytest.mark.torch
def test_the_committed_token_layouts_are_llama4_processors(sizes):
  assert helpers.committed_ids()["llama4-layout"][helpers.l4v_layout_key(sizes)] == helpers.hf_layout_ids(sizes)


@pytest.mark.parametrize("sizes", helpers.L4V_LAYOUTS, ids=helpers.l4v_layout_key)
def test_token_layout_matches_llama4_processor(sizes):
  """1x1, 1x2, 2x1 and 2x2 grids, and two images in one prompt: our expanded ids == the processor's
  (committed, checked live above)."""
  images = [Image.fromarray(picture(*s)) for s in sizes]
  text = helpers.l4v_layout_text(sizes)
  want = helpers.committed_ids()["llama4-layout"][helpers.l4v_layout_key(sizes)]
  c = tiny_config()
  ids = [VOCAB.get(w, SPECIAL.get(w)) for w in text.split()]
  got = images_lib.expand(ids, [images_lib.prepare(im, c).tokens for im in images], c, "prompt 0")
  assert got == want
  tpt = images_lib.tile_tokens(c)
  assert got.count(c.image_token_id) == tpt * sum(images_lib.num_tiles(images_lib.best_grid(*s, 4, S)) for s in sizes)
  with pytest.raises(DataError, match=r"^1 image\(s\) but 2 image markers \(token 54\) \(prompt 3\)$"):
    images_lib.expand([5, 54, 54], [[1]], c, "prompt 3")
  with pytest.raises(ConfigError, match=r"^max_image_tiles=0: an image needs at least one tile"):
    images_lib.prepare(images[0], tiny_config(max_image_tiles=0))


@pytest.fixture(scope="module")
def tiny(converted, tmp_path_factory):
  """(Our converted directory, an image file whose tiles need no resizing but the global tile's 2:1)."""
  out = converted
  path = str(tmp_path_factory.mktemp("img") / "cat.png")
  Image.fromarray(picture(32, 16, seed=3)).save(path)
  return out, path


def our_config(out, *overrides):
  args = [os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={out}/params"]
  return config.load([*args, *IDS, "max_prefill_predict_length=48", "max_target_length=64", *overrides], {})


def test_image_file_to_logits_and_engine_tokens_match_hugging_face(tiny):
  """image file -> HF's processor -> HF's model (committed: hf_references/vision/llama4-vision, checked against
  a live run in llama4_vision_test's torch tier), and image file -> our pipeline -> our model: the same ids,
  pixels and logits; the Engine's prefill + KV-cache decode gives HF's greedy tokens and our own cache-free
  forwards' tokens."""
  out, path = tiny
  hf = helpers.vision_reference_outputs("llama4-vision")
  hf_ids, ref, hf_new = hf["file_ids"], hf["file_logits"], hf["file_greedy"][0]

  c = our_config(out, "decode_sampling_strategy=greedy")
  prompt = [5, SPECIAL["<|image|>"], 6, 7]
  prepared = images_lib.prepare(path, c, "prompt 0")
  ids = images_lib.expand(prompt, [prepared.tokens], c, "prompt 0")
  assert ids == hf_ids[0].tolist() and prepared.tiles.shape == (3, S, S, 3)  # 2 x 1 tiles + the global one
  np.testing.assert_array_equal(prepared.tiles, hf["file_pixels"])
  ours = load_converted(out, *IDS)
  images, t = jnp.asarray(prepared.tiles[None]), len(ids)
  n = t + 8  # full forwards of the prompt padded to t + 8 (causal: the padding changes nothing before it)
  forward = jax.jit(lambda s: ours(s, jnp.arange(n)[None], jnp.ones_like(s), images=images)[0])
  seq = jnp.zeros((1, n), jnp.int32).at[0, :t].set(jnp.asarray(ids))
  np.testing.assert_allclose(np.asarray(forward(seq)[:t]), ref[0], rtol=2e-5, atol=2e-5)
  for i in range(t, n):  # cache-free greedy decoding
    seq = seq.at[0, i].set(forward(seq)[i - 1].argmax().astype(jnp.int32))
  np.testing.assert_array_equal(np.asarray(seq[0, t:]), hf_new)

  engine = Engine.load(c, tokenizer=None)  # prefill (the image's tiles) + KV-cache decode steps
  got = engine.generate([prompt], 8, images=[[path]], stop_tokens=[]).completions[0].tokens
  np.testing.assert_array_equal(got, hf_new)


def test_decode_with_image_path(tiny, capsys):
  out, path = tiny
  args = [os.path.join(out, "config.yml"), "run_name=d", f"load_parameters_path={out}/params", *IDS]
  args += [f"image_path={path}", "prompt=1+1", "decode_max_new_tokens=4", "max_prefill_predict_length=48"]
  decode.main(["decode.py", *args, "max_target_length=64"])  # byte tokens fit the vocabulary of 64
  assert f"Prompt: '1+1' with image(s) {path}" in capsys.readouterr().out


def test_sft_rows_pack_tiles_and_name_bad_rows(tmp_path):
  """jsonl rows with images for a llama4 model: each image's block in the tokens (no loss on it), its tiles in
  the row's tile slots in order; packing stops when the tiles would not fit; bad rows fail with one line."""
  from MaxText.data import chat, sft
  from MaxText.tests.conftest import BASE, TINY

  tok = make_tokenizer(str(tmp_path / "tok"))
  files = {}
  for name, size in (("wide", (16, 32)), ("square", (16, 16)), ("big", (32, 32))):
    files[name] = str(tmp_path / f"{name}.png")
    Image.fromarray(picture(*size)).save(files[name])
  (tmp_path / "bad.png").write_bytes(b"not a png")
  args = [BASE, "run_name=s", *TINY, "decoder_block=llama4", "use_multimodal=true", "image_size_for_vit=16"]
  args += ["patch_size_for_vit=4", "image_token_id=300", "image_start_token_id=301", "image_end_token_id=302"]
  args += ["image_global_token_id=303", "tile_x_separator_token_id=304", "tile_y_separator_token_id=305"]
  args += ["max_image_tiles=4", "images_per_row=2", "image_tiles_per_row=5", "use_sft=true", "vocab_size=320"]
  args += ["dataset_type=text", f"dataset_path={tmp_path}/chat.jsonl", "tokenizer_type=huggingface"]
  args += [f"tokenizer_path={tok.path}", "max_target_length=128"]
  c = config.load(args, {})
  template = chat.load_template(tok, c.sft_chat_template)
  messages = [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": "Paris."}]

  def encode(*rows, cfg=c):
    return sft.encode(cfg, tok, template, iter([(f"chat.jsonl:{i}", r) for i, r in enumerate(rows, 1)]), "t")

  ex = encode({"messages": messages, "images": [files["wide"]]}, {"messages": messages, "images": [files["square"]]})
  assert ex.tiles.tolist() == [3, 1]  # 1 x 2 + global; 1 x 1
  rows = sft.ExampleRows(ex, 128, True, None)
  assert rows.rows_per_epoch == 1  # 3 + 1 tiles fit the 5 slots
  tokens, segments, _, mask, pixels = rows.rows(np.array([0]))
  wide = images_lib.prepare(files["wide"], c)
  square = images_lib.prepare(files["square"], c)
  assert pixels.shape == (1, 5, 16, 16, 3) and not pixels[0, 4].any()  # the fifth slot empty
  np.testing.assert_array_equal(pixels[0, :4], np.concatenate([wide.tiles, square.tiles]))
  first = tokens[0][segments[0] == 1].tolist()
  assert first[: len(wide.tokens)] == wide.tokens and not mask[0][: len(wide.tokens)].any()
  assert mask[0].any() and (tokens[0] == 300).sum() == 4 * 4

  big = encode(*[{"messages": messages, "images": [files[k]]} for k in ("big", "square", "wide")])
  assert big.tiles.tolist() == [5, 1, 3] and sft.ExampleRows(big, 128, True, None).rows_per_epoch == 2  # 5, then 1 + 3
  bad = [
    ({"images": [files["big"], files["square"]]}, c, r"^chat.jsonl:1: its 2 image\(s\) make 6 tiles, more than"),
    ({"images": [str(tmp_path / "no.png")]}, c, r"no.png' \(chat.jsonl:1\) cannot be read"),
    ({"images": [str(tmp_path / "bad.png")]}, c, r"bad.png' \(chat.jsonl:1\) is not a readable image"),
    ({"images": [files["square"]] * 3}, c, r"^chat.jsonl:1 has 3 images, more than images_per_row=2$"),
    ({"images": [files["square"]]}, c.replace(use_multimodal=False), r"image\(s\) \(chat.jsonl:1\) for a text-only"),
  ]
  for row, cfg, message in bad:
    with pytest.raises(DataError, match=message):
      encode({"messages": messages, **row}, cfg=cfg)
