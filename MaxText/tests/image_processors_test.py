"""Images and prompts exactly as transformers' processors make them: data/resize.py against torch's uint8 kernel
(the processors' default torchvision path), Gemma 3 and Llama 4 pixels of odd-sized images against
Gemma3ImageProcessor / Llama4ImageProcessor, and the ids of prompts and SFT rows with one and two images against
Gemma3Processor (its "\\n\\n" around each image block) and Llama4Processor."""

import json
import os
import types

import numpy as np
import pytest
from PIL import Image

from MaxText.data import chat, images, sft
from MaxText.data import resize as resize_lib
from MaxText.data.tokenizer import HuggingFaceTokenizer
from MaxText.tests import helpers
from MaxText.tests.conftest import HAS_TORCH

if HAS_TORCH:  # the `torch`-marked tests' live references
  import torch
  import torchvision.transforms.v2.functional as tvF
  import transformers

tiny = helpers.end_to_end_script("make_tiny_vision_model")

ODD = helpers.ODD_SHAPES
picture = helpers.picture


def torch_resize(image, height, width):
  t = torch.from_numpy(image).permute(2, 0, 1).contiguous()
  out = tvF.resize(t, [height, width], interpolation=tvF.InterpolationMode.BILINEAR, antialias=True)
  return out.permute(1, 2, 0).numpy()


@pytest.mark.torch
def test_resize_equals_torchs_uint8_kernel():
  if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") and os.uname().machine not in ("aarch64",):
    pytest.skip("torchvision resizes uint8 in float32 on this CPU (no native uint8 kernel)")
  rng = np.random.default_rng(1)
  sizes = [(h, w, *rng.integers(1, 300, 2)) for h, w in rng.integers(1, 300, (40, 2))]
  for h, w, out_h, out_w in sizes + [(3000, 40, 896, 896), (1, 1, 5, 3), (37, 53, 37, 20)]:
    image = picture(h, w, int(out_h))
    np.testing.assert_array_equal(resize_lib.resize(image, out_h, out_w), torch_resize(image, out_h, out_w))


def gemma3_config(size):
  c = types.SimpleNamespace(decoder_block="gemma3", image_size_for_vit=size, mm_tokens_per_image=4)
  c.image_start_token_id, c.image_end_token_id, c.image_token_id = tiny.BOI, tiny.EOI, tiny.IMAGE
  c.use_multimodal, c.images_per_row, c.image_tiles_per_row, c.max_image_pixels = True, 2, 0, 89478485
  return c


def llama4_config(size, max_tiles):
  c = types.SimpleNamespace(decoder_block="llama4", image_size_for_vit=size, max_image_tiles=max_tiles)
  c.patch_size_for_vit, c.pixel_shuffle_ratio_for_vit, c.image_token_id = 4, 0.5, 1
  c.image_start_token_id = c.image_end_token_id = c.tile_x_separator_token_id = c.tile_y_separator_token_id = 2
  c.image_global_token_id = 3
  return c


def our_tiles(case):
  """data/images.py's tiles [N, H, W, C] for a helpers.PROCESSED-style case."""
  processor, size, max_tiles, height, width, seed, style = case
  image = Image.fromarray(picture(height, width, seed, style))
  c = gemma3_config(size) if processor == "gemma3" else llama4_config(size, max_tiles)
  return images.prepare(image, c).tiles


def assert_equals_the_processor(case):
  """Ours == the live processor's; the committed tiles (if the case has them) are the live ones: current."""
  want = helpers.hf_processed(case)
  np.testing.assert_array_equal(our_tiles(case), want)
  if case in helpers.PROCESSED:
    np.testing.assert_array_equal(helpers.committed_processed()[helpers.processed_key(case)], want)


@pytest.fixture(scope="module")
def committed():
  return helpers.committed_processed()


@pytest.mark.parametrize("case", helpers.PROCESSED, ids=helpers.processed_key)
def test_tiles_equal_the_committed_processor_tiles(committed, case):
  """Gemma 3 and Llama 4 tiles of odd-sized, smooth and transparent images, as the processors made them."""
  assert sorted(committed) == sorted(map(helpers.processed_key, helpers.PROCESSED))
  np.testing.assert_array_equal(our_tiles(case), committed[helpers.processed_key(case)])


@pytest.mark.parametrize("size", [16, 896])
@pytest.mark.parametrize("shape", ODD)
@pytest.mark.torch
def test_gemma3_pixels_equal_the_default_processor(size, shape):
  assert_equals_the_processor(("gemma3", size, 0, *shape, 0, "random"))


@pytest.mark.parametrize("size, max_tiles", [(16, 4), (336, 16)])
@pytest.mark.parametrize("shape", ODD)
@pytest.mark.torch
def test_llama4_tiles_equal_the_processor(size, max_tiles, shape):
  assert_equals_the_processor(("llama4", size, max_tiles, *shape, 2, "random"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
  """(our tokenizer over the tiny vision model's tokenizer, trained on runs of newlines so that "\\n" + "\\n\\n"
  merge into one token (as in Gemma's vocabulary), its directory)."""
  directory = str(tmp_path_factory.mktemp("gemma3tok"))
  helpers.gemma3_tokenizer(directory)
  return HuggingFaceTokenizer(directory), directory


def processors_ids(text, n, special=False):
  """Gemma3Processor's ids for text with n images (committed by hf_references/make_processors.py)."""
  return helpers.committed_ids()["gemma3-prompts"][helpers.g3_prompt_key(text, n, special)]


def ours(text, n, c, tok):
  return images.expand(tok.encode(images.processor_text(text, n, c, tok)[0]), n, c, "prompt 0")


@pytest.mark.torch
def test_the_committed_gemma3_prompt_ids_are_the_processors(gemma3):
  """Every committed prompt's ids, the SFT row's included, are a live Gemma3Processor's."""
  _, directory = gemma3
  processor = helpers.gemma3_processor(directory)
  for text, n, special in [*helpers.G3_PROMPTS, (helpers.g3_sft_text(directory), 2, False)]:
    assert processors_ids(text, n, special) == helpers.hf_gemma3_prompt_ids(processor, text, n, special), text


@pytest.mark.parametrize("text, n", [(text, n) for text, n, special in helpers.G3_PROMPTS if not special])
def test_gemma3_prompt_ids_equal_the_processors(gemma3, text, n):
  tok, _ = gemma3
  got = ours(text, n, gemma3_config(16), tok)
  assert got == processors_ids(text, n)
  assert got.count(tiny.BOI) == n and got != images.expand(tok.encode(text), n, gemma3_config(16))  # "\n\n" added


def test_a_gemma3_prompt_without_a_marker_gets_the_images_first(gemma3):
  tok, _ = gemma3
  text = "<s>What colour is this?"
  c = gemma3_config(16)
  assert images.processor_text(text, 2, c, tok)[0] == "<s>" + "\n\n<start_of_image>\n\n" * 2 + "What colour is this?"
  assert ours(text, 2, c, tok) == processors_ids("<s><start_of_image><start_of_image>What colour is this?", 2, True)
  assert images.processor_text(text, 0, c, tok)[0] == text  # no image: the text as it is


def test_gemma3_sft_rows_equal_the_processors_ids_and_mask_the_reply(gemma3, tmp_path):
  tok, directory = gemma3
  files = []
  for i in range(2):
    files.append(str(tmp_path / f"{i}.png"))
    Image.fromarray(picture(37, 53, i)).save(files[-1])
  messages = helpers.G3_SFT_MESSAGES
  c = gemma3_config(16)
  c.sft_messages_column, c.sft_prompt_column, c.sft_completion_column = "messages", "prompt", "completion"
  c.sft_train_on_completion_only, c.max_target_length, c.sft_images_column = True, 128, "images"
  template = chat.load_template(tok)  # the tokenizer_config.json chat template (ChatML)
  examples = sft.encode(c, tok, template, iter([("row 0", {"messages": messages, "images": files})]), "rows")
  assert template.render(messages) == helpers.g3_sft_text(directory)
  np.testing.assert_array_equal(examples.tokens, processors_ids(template.render(messages), 2))
  reply = examples.tokens[examples.loss_mask.astype(bool)]  # the reply and the template's end of turn
  assert tok.decode(reply) == "It is red.\n" and tok.token_text(int(reply[-2])) == "<|im_end|>"


@pytest.mark.torch
def test_llama4_prompts_are_unchanged_and_equal_the_processors(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

  vocab = {"[UNK]": 0, "describe": 5, "this": 6, "and": 7}
  special = {"<|image_start|>": 50, "<|image_end|>": 51, "<|tile_x_separator|>": 52, "<|tile_y_separator|>": 53}
  special |= {"<|image|>": 54, "<|patch|>": 63}
  hf = Tokenizer(models.WordLevel(vocab | special, unk_token="[UNK]"))
  hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  hf.add_special_tokens(list(special))
  hf.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
  tok = HuggingFaceTokenizer(str(tmp_path))
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, unk_token="[UNK]")
  image_processor = transformers.Llama4ImageProcessor(size={"height": 16, "width": 16}, max_patches=4)
  processor = transformers.Llama4Processor(image_processor, fast, patch_size=4, pixel_shuffle_ratio=0.5)
  c = types.SimpleNamespace(decoder_block="llama4", image_size_for_vit=16, max_image_tiles=4, use_multimodal=True)
  c.patch_size_for_vit, c.pixel_shuffle_ratio_for_vit, c.image_token_id, c.image_global_token_id = 4, 0.5, 63, 54
  c.image_start_token_id, c.image_end_token_id = 50, 51
  c.tile_x_separator_token_id, c.tile_y_separator_token_id = 52, 53
  pictures = [Image.fromarray(picture(37, 53)), Image.fromarray(picture(16, 16))]
  text = "describe <|image|> and <|image|> this"
  assert images.processor_text(text, 2, c, tok)[0] == text
  want = processor(text=text, images=pictures, return_tensors="pt")["input_ids"][0].tolist()
  blocks = [images.prepare(p, c).tokens for p in pictures]
  assert images.expand(tok.encode(text), blocks, c, "prompt 0") == want
