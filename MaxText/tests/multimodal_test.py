"""Gemma 3 with images (use_multimodal) against transformers' Gemma3ForConditionalGeneration: a tiny random
model converted both ways (bit-exact), float32 logits of an image+text prompt, 16 greedy tokens; the
bidirectional mask over each image's tokens; text-only use of the converted checkpoint."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import checkpointing, config, models
from MaxText.convert import hf_to_maxtext, maxtext_to_hf
from MaxText.layers import vision
from MaxText.parallel import plan as plan_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TEXT |= dict(vocab_size=64, head_dim=8, sliding_window=4, query_pre_attn_scalar=6)
VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, image_size=16)
VISION |= dict(patch_size=4, vision_use_head=False)
IMAGE, BOI, EOI = 60, 58, 59


def hf_model(tmp_path):
  torch.manual_seed(0)
  cfg = transformers.Gemma3Config(
    text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=IMAGE,
    boi_token_index=BOI, eoi_token_index=EOI,
  )  # fmt: skip
  model = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias") or "mm_input_projection" in name:
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "layer_norm" in name and name.endswith("weight") else 0.0))
  path = os.path.join(tmp_path, "hf")
  model.save_pretrained(path)
  return model, path


def load(out_dir, *overrides):
  c = config.load([os.path.join(out_dir, "config.yml"), "run_name=t", "dtype=float32", *overrides], {})
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.build(c, nnx.Rngs(0), plan_lib.build(c))), nnx.Param)
  return c, nnx.merge(graphdef, checkpointing.load_params(os.path.join(out_dir, "params"), abstract))


def prompt(rng):
  """Two rows: text, an image (boi, 4 placeholders, eoi), text, a second image, text."""
  image = [BOI] + [IMAGE] * 4 + [EOI]
  rows = [list(rng.integers(1, 50, 3)) + image + list(rng.integers(1, 50, 2)) + image + [7] for _ in range(2)]
  return np.asarray(rows)


def test_image_blocks_and_mask():
  tokens = jnp.asarray([[1, IMAGE, IMAGE, 2, IMAGE, 3]])
  np.testing.assert_array_equal(vision.image_blocks(tokens, IMAGE), [[-1, 0, 0, -1, 1, -1]])


def test_gemma3_multimodal_matches_hugging_face(tmp_path):
  model, hf_path = hf_model(tmp_path)
  rng = np.random.default_rng(0)
  tokens = prompt(rng)
  pixels = rng.uniform(-1, 1, (4, 3, 16, 16)).astype(np.float32)  # two images per row, channels first
  token_type_ids = (tokens == IMAGE).astype(np.int64)
  with torch.no_grad():
    ref = model(
      input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels), token_type_ids=torch.tensor(token_type_ids)
    ).logits.numpy()
  out = os.path.join(tmp_path, "mt")
  hf_to_maxtext.convert(hf_path, out, scan_layers=True)
  c, ours_model = load(out)
  images = jnp.asarray(pixels.transpose(0, 2, 3, 1).reshape(2, 2, 16, 16, 3))
  b, t = tokens.shape
  pos, seg = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)
  got = np.asarray(ours_model(jnp.asarray(tokens), pos, seg, images=images))
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

  # 16 greedy tokens: transformers' generate against full forwards of the growing sequence
  with torch.no_grad():
    hf_gen = model.generate(
      input_ids=torch.tensor(tokens[:1]), pixel_values=torch.tensor(pixels[:2]),
      token_type_ids=torch.tensor(token_type_ids[:1]), max_new_tokens=16, do_sample=False,
    ).numpy()[0, t:]  # fmt: skip
  graphdef, state = nnx.split(ours_model)
  n = t + 16  # one compiled shape: causal attention ignores the zeros after the current token

  @jax.jit
  def step(state, seq, i):
    logits = nnx.merge(graphdef, state)(seq, jnp.arange(n)[None], jnp.ones((1, n), jnp.int32), images=images[:1])
    return seq.at[0, i + 1].set(jnp.argmax(logits[0, i]))

  seq = jnp.zeros((1, n), jnp.int32).at[:, :t].set(tokens[:1])
  for i in range(t - 1, n - 1):
    seq = step(state, seq, i)
  np.testing.assert_array_equal(seq[0, t:], hf_gen)

  # the way back is bit-exact, and the text model alone reads the same checkpoint
  back = os.path.join(tmp_path, "back")
  maxtext_to_hf.convert(
    config.load([os.path.join(out, "config.yml"), "run_name=t", f"load_parameters_path={out}/params"], {}), back
  )
  original = safetensors_torch.load_file(os.path.join(hf_path, "model.safetensors"))
  exported = {}
  for name in set(json.load(open(os.path.join(back, "model.safetensors.index.json")))["weight_map"].values()):
    exported |= safetensors_torch.load_file(os.path.join(back, name))
  assert set(exported) == set(original)
  for name, tensor in original.items():
    assert torch.equal(exported[name], tensor), name
  reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(back).float().eval()
  assert isinstance(reloaded, transformers.Gemma3ForConditionalGeneration)
  text = tokens[:, :3]
  with torch.no_grad():
    text_ref = model(input_ids=torch.tensor(text)).logits.numpy()
  _, text_model = load(out, "use_multimodal=false")
  text_got = text_model(jnp.asarray(text), jnp.broadcast_to(jnp.arange(3), (2, 3)), jnp.ones((2, 3), jnp.int32))
  np.testing.assert_allclose(np.asarray(text_got), text_ref, rtol=1e-5, atol=1e-5)
