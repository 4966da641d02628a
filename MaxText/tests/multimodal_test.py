"""Gemma 3 with images (use_multimodal) against transformers' Gemma3ForConditionalGeneration (a tiny random
model committed with its outputs under hf_references/vision/; the `torch` tier checks them against a live
build): converted both ways (bit-exact), float32 logits of an image+text prompt, 16 greedy tokens (full forwards,
and the Engine's KV-cache decode); decode.py with image_path; text-only use of the converted checkpoint; the
image helpers' errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from MaxText import checkpointing, config, decode, models, planner
from MaxText.convert import hf_to_maxtext
from MaxText.data import images as images_lib
from MaxText.errors import DataError
from MaxText.inference import Engine
from MaxText.layers import vision
from MaxText.tests import helpers
from MaxText.tests.helpers import assert_export_is_exact, make_tokenizer

IMAGE, BOI, EOI, NEW = helpers.G3V_IMAGE, helpers.G3V_BOI, helpers.G3V_EOI, helpers.VISION_NEW
REGENERATE = "regenerate with python3 MaxText/tests/hf_references/make_vision.py (after TEST=1 TORCH=1 bash setup.sh)"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(transformers' committed outputs, the committed HF directory's copy, our converted directory)."""
  tmp = tmp_path_factory.mktemp("gemma3mm")
  ref, hf_path = helpers.vision_reference("gemma3-vision", tmp)
  out = str(tmp / "mt")
  hf_to_maxtext.convert(hf_path, out, scan_layers=True)
  return ref, hf_path, out


def load(out_dir, *overrides):
  c = config.load([os.path.join(out_dir, "config.yml"), "run_name=t", "dtype=float32", *overrides], {})
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.build(c, nnx.Rngs(0), planner.build(c))), nnx.Param)
  return c, nnx.merge(graphdef, checkpointing.load_params(os.path.join(out_dir, "params"), abstract))


@pytest.mark.torch
def test_committed_reference_is_a_live_transformers_build():
  """hf_references/vision/gemma3-vision: a live Gemma3ForConditionalGeneration build gives the same tensors,
  logits and greedy tokens (a stale reference fails here)."""
  from MaxText.tests.hf_references import make_vision  # noqa: PLC0415 (imports torch)

  assert make_vision.check("gemma3-vision") == [], REGENERATE


def test_image_blocks_and_expand():
  tokens = jnp.asarray([[1, IMAGE, IMAGE, 2, IMAGE, 3]])
  np.testing.assert_array_equal(vision.image_blocks(tokens, IMAGE), [[-1, 0, 0, -1, 1, -1]])
  c = config.load(["MaxText/configs/base.yml", "run_name=t", "use_multimodal=true", "mm_tokens_per_image=2"], {})
  start, end, image = c.image_start_token_id, c.image_end_token_id, c.image_token_id
  assert images_lib.expand([2, 5, start, 6], 1, c, bos=2) == [2, 5, start, image, image, end, 6]
  assert images_lib.expand([2, 5], 1, c, bos=2) == [2, start, image, image, end, 5]
  with pytest.raises(DataError, match=r"2 image\(s\) but 1 image markers .*row 3"):
    images_lib.expand([start, 5], 2, c, "row 3")
  with pytest.raises(DataError, match="text-only model"):
    images_lib.expand([5], 1, c.replace(use_multimodal=False), "row 1")


def test_load_errors_name_the_file(tmp_path):
  with pytest.raises(DataError, match=r"missing.png' \(row 4\) cannot be read"):
    images_lib.load(str(tmp_path / "missing.png"), 16, "row 4")
  (tmp_path / "bad.png").write_bytes(b"not a png")
  with pytest.raises(DataError, match=r"bad.png' \(row 5\) is not a readable image"):
    images_lib.load(str(tmp_path / "bad.png"), 16, "row 5")
  Image.fromarray(np.full((5, 9, 3), 255, np.uint8)).save(tmp_path / "white.png")
  np.testing.assert_allclose(images_lib.load(str(tmp_path / "white.png"), 16), np.ones((16, 16, 3)))


def test_logits_and_greedy_tokens_match_hugging_face(converted):
  hf, _, out = converted
  x = helpers.vision_inputs("gemma3-vision")
  tokens, pixels, ref = x["tokens"], x["pixels"], hf["logits"]  # two images per row, channels first
  _, ours = load(out)
  images = jnp.asarray(pixels.transpose(0, 2, 3, 1).reshape(2, 2, 16, 16, 3))
  b, t = tokens.shape
  pos, seg = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens), pos, seg, images=images)), ref, rtol=1e-5, atol=1e-5)
  # Query blocks of 2 (attention_query_chunk; 512 by default at scale) cut both images' blocks.
  _, chunked = load(out, "attention_query_chunk=2")
  got = chunked(jnp.asarray(tokens), pos, seg, images=images)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)

  # 16 greedy tokens from full forwards of the growing sequence (one compiled shape: causal attention ignores
  # the zeros after the current token)
  graphdef, state = nnx.split(ours)
  n = t + NEW

  @jax.jit
  def step(state, seq, i):
    logits = nnx.merge(graphdef, state)(seq, jnp.arange(n)[None], jnp.ones((1, n), jnp.int32), images=images[:1])
    return seq.at[0, i + 1].set(jnp.argmax(logits[0, i]))

  seq = jnp.zeros((1, n), jnp.int32).at[:, :t].set(tokens[:1])
  for i in range(t - 1, n - 1):
    seq = step(state, seq, i)
  np.testing.assert_array_equal(np.asarray(seq[0, t:]), hf["greedy"][0])


def test_engine_and_decode_with_images(converted, tmp_path, capsys):
  """The Engine's prefill (bidirectional image blocks over the KV cache) and decode steps give transformers'
  greedy tokens; the prompt's <start_of_image> markers become whole image blocks; decode.py reads image_path."""
  hf, _, out = converted
  x = helpers.vision_inputs("gemma3-vision")
  pixels = np.random.default_rng(1).integers(0, 256, (2, 16, 16, 3)).astype(np.uint8)
  files = []
  for i, p in enumerate(pixels):
    files.append(str(tmp_path / f"cat{i}.png"))
    Image.fromarray(p).save(files[-1])
  c = config.load(
    [os.path.join(out, "config.yml"), "run_name=t", "dtype=float32", f"load_parameters_path={out}/params"]
    + ["max_prefill_predict_length=32", "max_target_length=64", "decode_sampling_strategy=greedy"],
    {},
  )
  engine = Engine.load(c, tokenizer=None)
  ids = [3, 4, BOI, 5, BOI, 6]
  got = engine.generate([ids], NEW, images=[files], stop_tokens=[]).completions[0].tokens
  # The reference's inputs are these ids and files, as data/images.py expands and loads them.
  np.testing.assert_array_equal([images_lib.expand(ids, 2, c)], x["engine_tokens"])
  np.testing.assert_array_equal(np.stack([images_lib.load(f, 16) for f in files]), x["engine_pixels"])
  np.testing.assert_array_equal(got, hf["engine_greedy"][0])

  with pytest.raises(DataError, match=r"1 image\(s\) but 2 image markers \(token 58\) \(prompt 0\)"):
    engine.generate([ids], 2, images=[files[:1]])
  decode.main(
    [
      "decode.py",
      os.path.join(out, "config.yml"),
      "run_name=d",
      f"load_parameters_path={out}/params",
      f"image_path={files[0]}",
      "prompt=1+1",
      "decode_max_new_tokens=4",
      "max_prefill_predict_length=32",
      "max_target_length=64",
    ]
  )  # fmt: skip  (byte tokens fit vocab 64)
  assert f"Prompt: '1+1' with image(s) {files[0]}" in capsys.readouterr().out


def test_round_trip_is_exact_and_text_only_use_works(converted, tmp_path):
  hf, hf_path, out = converted
  back = str(tmp_path / "back")
  c = config.load([os.path.join(out, "config.yml"), "run_name=t", f"load_parameters_path={out}/params"], {})
  assert_export_is_exact(c, hf_path, back)
  assert json.load(open(os.path.join(back, "config.json")))["architectures"] == ["Gemma3ForConditionalGeneration"]
  assert json.load(open(os.path.join(back, "config.json")))["vision_config"]["patch_size"] == 4

  text, ref = helpers.vision_inputs("gemma3-vision")["text"], hf["text_logits"]
  _, text_model = load(out, "use_multimodal=false")
  got = text_model(jnp.asarray(text), jnp.broadcast_to(jnp.arange(4), (2, 4)), jnp.ones((2, 4), jnp.int32))
  np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


MM_TINY = ["decoder_block=gemma3", "base_num_decoder_layers=2", "use_multimodal=true", "image_size_for_vit=16"]
MM_TINY += ["patch_size_for_vit=4", "hidden_size_for_vit=16", "intermediate_size_for_vit=24", "mm_tokens_per_image=4"]
MM_TINY += ["num_hidden_layers_for_vit=1", "num_attention_heads_for_vit=2", "image_token_id=310"]
MM_TINY += ["image_start_token_id=311", "image_end_token_id=312", "images_per_row=2", "max_target_length=64"]


def vision_params(c, step):
  from MaxText import train  # noqa: PLC0415

  reader_path = train.checkpoint_path(c, step)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.build(c, nnx.Rngs(0), planner.build(c))), nnx.Param)
  params = nnx.to_pure_dict(checkpointing.load_params(reader_path, abstract))
  return params["vision_encoder"], params["decoder_norm"]


@pytest.mark.slow  # two short training runs (about 30 s each on an idle 2-core host)
@pytest.mark.parametrize("freeze", [True, False])
def test_sft_with_images_trains_and_freezes_the_vision_tower(tmp_path, freeze):
  """jsonl rows {"messages", "images"}: images decoded in the pipeline, packed 2 per row, loss on the replies;
  freeze_vision_encoder keeps the tower and projector exactly; false trains them."""
  from MaxText import train  # noqa: PLC0415
  from MaxText.tests.conftest import BASE, TINY, losses  # noqa: PLC0415

  tok = make_tokenizer(str(tmp_path / "tok"))
  rng = np.random.default_rng(0)
  records = []
  for i, color in enumerate(("red", "blue")):
    path = str(tmp_path / f"{color}.png")
    Image.fromarray(rng.integers(0, 256, (20, 24, 3)).astype(np.uint8)).save(path)
    messages = [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": ["Paris.", "Rome."][i]}]
    records.append({"messages": messages, "images": [path]})
  data = tmp_path / "chat.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in records * 2))
  args = [BASE, "run_name=mm", f"base_output_directory={tmp_path}", *TINY, *MM_TINY, "dataset_type=text"]
  args += ["use_sft=true", f"dataset_path={data}", "tokenizer_type=huggingface", f"tokenizer_path={tok.path}"]
  args += ["vocab_size=320", "eval_fraction=0", "steps=2", "per_device_batch_size=2", "enable_checkpointing=true"]
  args += ["checkpoint_period=1", f"freeze_vision_encoder={str(freeze).lower()}"]
  c = config.load(args, {})
  train.run(c, jax.devices()[:1])
  assert all(np.isfinite(losses(c)))
  (v1, n1), (v2, n2) = vision_params(c, 1), vision_params(c, 2)
  same = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), v1, v2))
  assert all(same) if freeze else not any(same)
  assert not np.array_equal(n1["scale"], n2["scale"])  # the text model trains either way


def test_bad_image_rows_fail_with_one_line_naming_the_row(tmp_path):
  from MaxText.data import sft  # noqa: PLC0415

  path = str(tmp_path / "nothing.png")
  ex = sft.Examples(np.full(8, 5, np.int32), np.ones(8, np.uint8), np.array([0, 8]), [("chat.jsonl:3", [path])], 16, 2)
  with pytest.raises(DataError, match=r"nothing.png' \(chat.jsonl:3\) cannot be read"):
    sft.ExampleRows(ex, 8, False, None).rows(np.array([0]))


def test_flops_count_the_vision_tower():
  """Per image: 2 x (patch embedding 768 + q/k/v/o 1024 + MLP 768 weights) x 16 patches + 4 x 16 x 16 patches x width 16
  x 1 layer + 2 x projector 16 x 64 x 4 soft tokens = 106496 FLOPs; x 2 images per row / 64 tokens; x1 frozen,
  x3 not."""
  from MaxText import flops  # noqa: PLC0415
  from MaxText.tests.conftest import BASE, SIZES  # noqa: PLC0415

  base = [BASE, "run_name=f", *SIZES, *MM_TINY]
  frozen = flops.training_flops_per_token(config.load(base, {}))
  trained = flops.training_flops_per_token(config.load([*base, "freeze_vision_encoder=false"], {}))
  text = flops.training_flops_per_token(config.load([*base, "use_multimodal=false"], {}))
  assert frozen.vision == 106496 * 2 / 64 and trained.vision == 3 * frozen.vision and text.vision == 0
  assert frozen.total - frozen.vision == text.total  # the text model's count is unchanged
