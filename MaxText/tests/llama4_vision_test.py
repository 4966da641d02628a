"""Llama 4's vision tower against Hugging Face (a tiny random Llama4ForConditionalGeneration, PyTorch CPU):
image+text logits and 16 greedy tokens, the vision tensors' bit-exact round trip, text-only use."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import checkpointing, config, models
from MaxText.convert import hf_to_maxtext, llama4_vision_mapping
from MaxText.models import llama4_vision
from MaxText.parallel import plan as plan_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = dict(hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4, num_attention_heads=4)
TEXT |= dict(num_key_value_heads=2, vocab_size=64, head_dim=8, num_local_experts=4, interleave_moe_layer_step=2)
TEXT |= dict(
  attention_chunk_size=8, floor_scale=4, attn_scale=1.0, max_position_embeddings=64, tie_word_embeddings=False
)
# 16 x 16 tiles of 4 x 4 patches: a 4 x 4 grid, pixel-shuffled to 4 soft tokens per tile.
VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16)
VISION |= dict(
  patch_size=4, pixel_shuffle_ratio=0.5, projector_input_dim=24, projector_output_dim=24, vision_output_dim=24
)
IMAGE_TOKEN = 63
KEYS = [
  "use_multimodal=true", "image_size_for_vit=16", "patch_size_for_vit=4", "hidden_size_for_vit=16",
  "intermediate_size_for_vit=64", "num_hidden_layers_for_vit=2", "num_attention_heads_for_vit=2",
  "vision_layer_norm_epsilon=1e-5", "pixel_shuffle_ratio_for_vit=0.5", "projector_input_dim_for_vit=24",
  "projector_output_dim_for_vit=24", f"image_token_id={IMAGE_TOKEN}",
]  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(HF model, its state as numpy, MaxText model with the converted weights)."""
  tmp = tmp_path_factory.mktemp("l4v")
  torch.manual_seed(0)
  cfg = transformers.Llama4Config(text_config=TEXT, vision_config=VISION, image_token_index=IMAGE_TOKEN)
  model = transformers.Llama4ForConditionalGeneration(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  # The text decoder goes through the Llama4ForCausalLM converter.
  text = transformers.Llama4ForCausalLM(cfg.text_config).float().eval()
  prefix = llama4_vision_mapping.TEXT
  text.load_state_dict({k[len(prefix) :]: v for k, v in model.state_dict().items() if k.startswith(prefix)})
  text.save_pretrained(os.path.join(tmp, "hf"))
  hf_to_maxtext.convert(os.path.join(tmp, "hf"), os.path.join(tmp, "mt"), scan_layers=True)
  c = config.load([os.path.join(tmp, "mt", "config.yml"), "run_name=t", "dtype=float32", *KEYS], {})
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: models.build(c, nnx.Rngs(0), plan_lib.build(c))), nnx.Param)
  text_abstract = nnx.State({k: v for k, v in abstract.items() if k != "vision_encoder"})
  params = checkpointing.load_params(os.path.join(tmp, "mt", "params"), text_abstract).to_pure_dict()
  params["vision_encoder"] = llama4_vision_mapping.to_maxtext(state.__getitem__, 2, 2)
  params = jax.tree.map(jnp.asarray, params)
  state_tree = abstract.to_pure_dict()
  jax.tree.map(lambda a, b: None if a.shape == b.shape else pytest.fail(f"{a.shape} {b.shape}"), state_tree, params)
  abstract.replace_by_pure_dict(params)
  return model, state, nnx.merge(graphdef, abstract), tmp


def prompt(batch_images: int) -> np.ndarray:
  """Text, <|image_start|>-like text token, 4 placeholders per tile, more text (one row)."""
  rng = np.random.default_rng(1)
  head, tail = rng.integers(0, 60, 3), rng.integers(0, 60, 4)
  return np.concatenate([head, np.full(4 * batch_images, IMAGE_TOKEN), tail])[None]


def test_image_text_logits_and_greedy_tokens_match_hugging_face(converted):
  model, _, ours, _ = converted
  pixels = np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)  # two tiles, NCHW
  tokens = prompt(2)
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels)).logits.numpy()
  images = jnp.asarray(pixels.transpose(0, 2, 3, 1)[None])  # [B=1, N=2, H, W, C]
  t = tokens.shape[1]
  got = ours(jnp.asarray(tokens), jnp.arange(t)[None], jnp.ones((1, t), jnp.int32), images=images)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)

  # 16 greedy tokens: the whole (right-padded, causal) sequence recomputed each step, one compile.
  with torch.no_grad():
    hf_out = model.generate(
      input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels), max_new_tokens=16, do_sample=False
    )[0, t:].numpy()
  seq = jnp.zeros((1, t + 16), jnp.int32).at[:, :t].set(jnp.asarray(tokens))
  n = seq.shape[1]
  logits = jax.jit(lambda s: ours(s, jnp.arange(n)[None], jnp.ones_like(s), images=images)[0])
  for i in range(t, n):
    seq = seq.at[0, i].set(logits(seq)[i - 1].argmax().astype(jnp.int32))
  np.testing.assert_array_equal(np.asarray(seq[0, t:]), hf_out)


def test_vision_tensors_round_trip_bit_exact(converted):
  _, state, ours, _ = converted
  vision = {k: v for k, v in state.items() if llama4_vision_mapping.is_vision(k)}
  exported = llama4_vision_mapping.to_hf(nnx.state(ours.vision_encoder, nnx.Param).to_pure_dict())
  assert sorted(exported) == sorted(vision)
  for name, tensor in vision.items():
    assert exported[name].dtype == tensor.dtype and np.array_equal(exported[name], tensor), name


def test_text_only_use_of_the_multimodal_model(converted):
  """No images: the text model alone (logits as HF's with input_ids only); a text-only config refuses images."""
  model, _, ours, tmp = converted
  tokens = np.random.default_rng(3).integers(0, 60, (1, 9))
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
  pos, seg = jnp.arange(9)[None], jnp.ones((1, 9), jnp.int32)
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens), pos, seg)), ref, rtol=2e-5, atol=2e-5)
  c = config.load([os.path.join(tmp, "mt", "config.yml"), "run_name=t", "dtype=float32"], {})
  text_only = models.build(c, nnx.Rngs(0), plan_lib.build(c))
  assert text_only.vision_encoder is None
  with pytest.raises(ValueError, match="text-only"):
    text_only.forward(jnp.asarray(tokens), pos, seg, images=jnp.zeros((1, 1, 16, 16, 3)))


def test_pixel_shuffle_and_rope_layout():
  """Pixel shuffle folds 2 x 2 neighbours into channels; rope: columns then rows, from 1, class token 0."""
  x = jnp.arange(16 * 2, dtype=jnp.float32).reshape(1, 16, 2)  # a 4 x 4 grid, 2 channels
  y = llama4_vision.pixel_shuffle(x, 0.5)
  assert y.shape == (1, 4, 8)
  with torch.no_grad():
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle

    np.testing.assert_array_equal(np.asarray(y), pixel_shuffle(torch.tensor(np.asarray(x)), 0.5).numpy())
  angles = llama4_vision.rope_angles(4, 8, 10000.0)
  assert angles.shape == (17, 4) and not angles[-1].any()
  np.testing.assert_allclose(angles[5], [2.0, 2.0 * 0.01, 2.0, 2.0 * 0.01], rtol=1e-6)  # row 1, column 1
