"""Llama 4's vision tower against Hugging Face (a tiny random Llama4ForConditionalGeneration, committed with
transformers' outputs under hf_references/vision/): image+text logits and 16 greedy tokens, the vision tensors'
bit-exact round trip, text-only use; the `torch` tier checks the committed files against a live build."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import config
from MaxText import flops as flops_lib
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.layers.model_config import ModelConfig
from MaxText.models.llama4 import vision as llama4_vision
from MaxText.tests import helpers
from MaxText.tests.helpers import L4V_IMAGE_TOKEN, assert_export_is_exact, hf_keys, load_converted

REGENERATE = "regenerate with python3 MaxText/tests/hf_references/make_vision.py (after TEST=1 TORCH=1 bash setup.sh)"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(transformers' committed outputs, the committed HF directory's copy, the MaxText model converted from it,
  the MaxText directory)."""
  tmp = tmp_path_factory.mktemp("l4v")
  ref, hf_path = helpers.vision_reference("llama4-vision", tmp)
  out = os.path.join(tmp, "mt")
  hf_to_maxtext.convert(hf_path, out, scan_layers=True)
  return ref, hf_path, load_converted(out), out


@pytest.mark.torch
def test_committed_reference_is_a_live_transformers_build():
  """hf_references/vision/llama4-vision: a live Llama4ForConditionalGeneration build gives the same tensors,
  logits and greedy tokens (a stale reference fails here)."""
  from MaxText.tests.hf_references import make_vision  # noqa: PLC0415 (imports torch)

  assert make_vision.check("llama4-vision") == [], REGENERATE


def test_image_text_logits_and_greedy_tokens_match_hugging_face(converted):
  hf, _, ours, _ = converted
  x = helpers.vision_inputs("llama4-vision")
  pixels, tokens, ref, hf_out = x["pixels"], x["tokens"], hf["logits"], hf["greedy"][0]  # two tiles, NCHW
  images = jnp.asarray(pixels.transpose(0, 2, 3, 1)[None])  # [B=1, N=2, H, W, C]
  t = tokens.shape[1]
  # The prompt right-padded to t + 16 (causal: the padding changes nothing before it), one compile; the
  # first call's logits are the prompt's, then 16 greedy tokens recomputing the whole sequence each step.
  seq = jnp.zeros((1, t + 16), jnp.int32).at[:, :t].set(jnp.asarray(tokens))
  n = seq.shape[1]
  logits = jax.jit(lambda s: ours(s, jnp.arange(n)[None], jnp.ones_like(s), images=images)[0])
  np.testing.assert_allclose(np.asarray(logits(seq)[:t]), ref[0], rtol=2e-5, atol=2e-5)
  for i in range(t, n):
    seq = seq.at[0, i].set(logits(seq)[i - 1].argmax().astype(jnp.int32))
  np.testing.assert_array_equal(np.asarray(seq[0, t:]), hf_out)


def test_round_trip_to_hugging_face_is_bit_exact(converted, tmp_path):
  _, hf_path, _, out = converted
  back = os.path.join(tmp_path, "back")
  c = config.load([os.path.join(out, "config.yml"), "run_name=t", f"load_parameters_path={out}/params"], {})
  assert c.use_multimodal and c.image_token_id == L4V_IMAGE_TOKEN and c.num_hidden_layers_for_vit == 2
  assert_export_is_exact(c, hf_path, back)
  assert hf_keys(json.load(open(f"{back}/config.json"))) == hf_keys(json.load(open(f"{hf_path}/config.json")))


@pytest.mark.torch
def test_the_export_reloads_in_transformers(converted, tmp_path):
  import transformers  # noqa: PLC0415 (the torch tier)

  _, hf_path, _, out = converted
  c = config.load([os.path.join(out, "config.yml"), "run_name=t", f"load_parameters_path={out}/params"], {})
  back = os.path.join(tmp_path, "back")
  maxtext_to_hf.convert(c, back)
  reloaded = transformers.Llama4ForConditionalGeneration.from_pretrained(back)
  assert hf_keys(reloaded.config.to_dict()) == hf_keys(json.load(open(f"{hf_path}/config.json")))


def test_text_only_use_of_the_multimodal_model(converted):
  """No images: the text model alone (logits as HF's with input_ids only); the converted checkpoint loads
  with use_multimodal=false (its vision tensors unread) and then refuses images."""
  hf, _, ours, out = converted
  tokens, ref = helpers.vision_inputs("llama4-vision")["text"], hf["text_logits"]
  pos, seg = jnp.arange(9)[None], jnp.ones((1, 9), jnp.int32)
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens), pos, seg)), ref, rtol=2e-5, atol=2e-5)
  text_only = load_converted(out, "use_multimodal=false")
  assert text_only.vision_encoder is None
  np.testing.assert_allclose(np.asarray(text_only(jnp.asarray(tokens), pos, seg)), ref, rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="text-only"):
    text_only.forward(jnp.asarray(tokens), pos, seg, images=jnp.zeros((1, 1, 16, 16, 3)))


# transformers' pixel_shuffle(arange(32).reshape(1, 16, 2), 0.5): each 2 x 2 block's channels, row by row.
PIXEL_SHUFFLED = [[[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15], [16, 17, 18, 19, 24, 25, 26, 27]]]
PIXEL_SHUFFLED[0].append([20, 21, 22, 23, 28, 29, 30, 31])


def test_pixel_shuffle_and_rope_layout():
  """Pixel shuffle folds 2 x 2 neighbours into channels; rope: columns then rows, from 1, class token 0."""
  x = jnp.arange(16 * 2, dtype=jnp.float32).reshape(1, 16, 2)  # a 4 x 4 grid, 2 channels
  y = llama4_vision.pixel_shuffle(x, 0.5)
  assert y.shape == (1, 4, 8)
  np.testing.assert_array_equal(np.asarray(y), PIXEL_SHUFFLED)
  angles = llama4_vision.rope_angles(4, 8, 10000.0)
  assert angles.shape == (17, 4) and not angles[-1].any()
  np.testing.assert_allclose(angles[5], [2.0, 2.0 * 0.01, 2.0, 2.0 * 0.01], rtol=1e-6)  # row 1, column 1


def test_flops_count_the_vision_tower_per_image():
  """Scout with images: the text count is unchanged, the tower adds its per-image FLOPs over the row's tokens
  (x1 frozen, x3 trained); 144 soft tokens per tile."""
  base = [os.path.join(config.CONFIG_DIR, "base.yml"), "run_name=t", "model_name=llama4-17b-16e"]
  base += [
    "max_target_length=8192",
    "override_model_config=true",
    "num_hidden_layers_for_vit=2",
  ]  # the count is linear in layers
  text = flops_lib.training_flops_per_token(config.load(base, {}))
  frozen = flops_lib.training_flops_per_token(config.load([*base, "use_multimodal=true"], {}))
  trained_c = config.load([*base, "use_multimodal=true", "freeze_vision_encoder=false"], {})
  trained = flops_lib.training_flops_per_token(trained_c)
  assert text.vision == 0 and (frozen.matmul, frozen.attention) == (text.matmul, text.attention)
  d, n, m = 1408, 24 * 24, 144  # width, patches, soft tokens
  per_layer = 2 * (n + 1) * (4 * d * d + 2 * d * 5632) + 4 * (n + 1) ** 2 * d
  per_image = 2 * n * 3 * 14 * 14 * d + 2 * per_layer + 2 * m * (4 * d * 4096 + 4096 * 4096 + 4096 * 5120)
  assert frozen.vision == pytest.approx(per_image / 8192) and trained.vision == pytest.approx(3 * per_image / 8192)
  assert frozen.total == pytest.approx(text.total + frozen.vision)
  assert llama4_vision.tokens_per_image(ModelConfig.from_config(trained_c)) == m
