"""A tiny random Hugging Face Gemma3ForConditionalGeneration (SigLIP tower, projector, Gemma 3 text model) with a
chat tokenizer, three solid-colour PNGs and a chat .jsonl about them (for end_to_end/cpu/multimodal.sh).

  python3 end_to_end/cpu/make_tiny_vision_model.py OUT_DIR

Writes OUT_DIR/hf (config.json, model.safetensors, tokenizer.json, tokenizer_config.json), OUT_DIR/{red,green,blue}.png
and OUT_DIR/chat.jsonl: one {"messages": [...], "images": [path]} row per line, the user turn starting with the
<start_of_image> marker (token 5) where the image goes; the reply names the colour. Without torch: numpy draws the
weights as transformers initialises the model (its projector starts at zero), safetensors writes them.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from PIL import Image
from safetensors.numpy import save_file

CHATML = (  # the same ChatML template as make_tiny_chat_model.py
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
BOI, EOI, IMAGE = (len(SPECIAL) + i for i in range(3))  # special tokens after the chat ones: 5, 6, 7
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QUESTIONS = ["What colour is this?", "Which colour do you see?", "Name the colour.", "What is the colour?"]
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TEXT |= dict(head_dim=16, vocab_size=512, sliding_window=16, query_pre_attn_scalar=16, max_position_embeddings=128)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32)
VISION |= dict(patch_size=8, vision_use_head=False)
TOKENS_PER_IMAGE = 4


def gemma3_config() -> dict:
  """config.json of a Gemma3ForConditionalGeneration of shapes TEXT and VISION, with the keys transformers writes."""
  rope = {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"}}
  rope |= {"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
  text = dict(TEXT, model_type="gemma3_text", _sliding_window_pattern=6, attention_bias=False, attention_dropout=0.0)
  text |= dict(attn_logit_softcapping=None, final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh")
  text |= dict(bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.02, rms_norm_eps=1e-6)
  text |= dict(layer_types=["sliding_attention"] * TEXT["num_hidden_layers"], rope_parameters=rope)
  text |= dict(tie_word_embeddings=True, use_bidirectional_attention=False, use_cache=True)
  vision = dict(VISION, model_type="siglip_vision_model", attention_dropout=0.0, hidden_act="gelu_pytorch_tanh")
  vision |= dict(layer_norm_eps=1e-6, num_channels=3)
  return {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "dtype": "float32",
    "boi_token_index": BOI, "eoi_token_index": EOI, "image_token_index": IMAGE, "initializer_range": 0.02,
    "mm_tokens_per_image": TOKENS_PER_IMAGE, "tie_word_embeddings": True, "text_config": text, "vision_config": vision,
  }  # fmt: skip


def text_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """The Gemma 3 text model: linear layers normal(0, 0.02), the padding row 0 of the embedding zero, norms zero
  (Gemma's norms scale by 1 + weight); the output head is the embedding (tied)."""
  normal = lambda *shape: rng.normal(0.0, 0.02, shape).astype(np.float32)  # noqa: E731
  h, i, d = TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["head_dim"]
  q, kv = TEXT["num_attention_heads"] * d, TEXT["num_key_value_heads"] * d
  embed = normal(TEXT["vocab_size"], h)
  embed[0] = 0.0
  out = {"language_model.model.embed_tokens.weight": embed}
  for n in range(TEXT["num_hidden_layers"]):
    at, mlp = f"language_model.model.layers.{n}.self_attn.", f"language_model.model.layers.{n}.mlp."
    out |= {at + "q_proj.weight": normal(q, h), at + "k_proj.weight": normal(kv, h)}
    out |= {at + "v_proj.weight": normal(kv, h)}
    out |= {at + "o_proj.weight": normal(h, q), at + "q_norm.weight": np.zeros(d, np.float32)}
    out |= {at + "k_norm.weight": np.zeros(d, np.float32)}
    out |= {mlp + "gate_proj.weight": normal(i, h), mlp + "up_proj.weight": normal(i, h)}
    out |= {mlp + "down_proj.weight": normal(h, i)}
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    out |= {f"language_model.model.layers.{n}.{norm}.weight": np.zeros(h, np.float32) for norm in norms}
  return out | {"language_model.model.norm.weight": np.zeros(h, np.float32)}


def vision_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
  """The SigLIP tower as transformers initialises it: Xavier-uniform attention and MLP kernels, the MLP biases
  normal(0, 1e-6), the patch embedding LeCun-normal (truncated at 2 std), the positions normal(0, 1/sqrt(width)),
  LayerNorms 1 and 0; and the projector, which starts at zero."""
  w, i, p = VISION["hidden_size"], VISION["intermediate_size"], VISION["patch_size"]
  xavier = lambda o, n: rng.uniform(-1, 1, (o, n)).astype(np.float32) * np.float32(np.sqrt(6 / (o + n)))  # noqa: E731
  ones, zeros = np.ones(w, np.float32), np.zeros(w, np.float32)
  fan_in = 3 * p * p
  patch = rng.standard_normal((w * fan_in * 2,))
  patch = patch[np.abs(patch) < 2][: w * fan_in].reshape(w, 3, p, p) / np.sqrt(fan_in) / 0.87962566103423978
  positions = (VISION["image_size"] // p) ** 2
  out = {"vision_tower.embeddings.patch_embedding.weight": patch.astype(np.float32)}
  out |= {"vision_tower.embeddings.patch_embedding.bias": zeros}
  position = rng.normal(0, w**-0.5, (positions, w)).astype(np.float32)
  out |= {"vision_tower.embeddings.position_embedding.weight": position}
  for n in range(VISION["num_hidden_layers"]):
    layer = f"vision_tower.encoder.layers.{n}."
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
      out |= {f"{layer}self_attn.{proj}.weight": xavier(w, w), f"{layer}self_attn.{proj}.bias": zeros}
    out |= {layer + "mlp.fc1.weight": xavier(i, w), layer + "mlp.fc2.weight": xavier(w, i)}
    out |= {layer + "mlp.fc1.bias": rng.normal(0, 1e-6, i).astype(np.float32)}
    out |= {layer + "mlp.fc2.bias": rng.normal(0, 1e-6, w).astype(np.float32)}
    for norm in ("layer_norm1", "layer_norm2"):
      out |= {f"{layer}{norm}.weight": ones, f"{layer}{norm}.bias": zeros}
  out |= {"vision_tower.post_layernorm.weight": ones, "vision_tower.post_layernorm.bias": zeros}
  out |= {"multi_modal_projector.mm_input_projection_weight": np.zeros((w, TEXT["hidden_size"]), np.float32)}
  return out | {"multi_modal_projector.mm_soft_emb_norm.weight": zeros}


def write_model(directory: str, seed: int = 0) -> None:
  """config.json and model.safetensors, as Gemma3ForConditionalGeneration.save_pretrained writes them."""
  rng = np.random.default_rng(seed)
  tensors = text_weights(rng) | vision_weights(rng)
  save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(gemma3_config(), f, indent=2, sort_keys=True)


def write_tokenizer(directory: str, texts: list[str]) -> None:
  """A byte-level BPE tokenizer.json with the chat and image special tokens, and its tokenizer_config.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  special = SPECIAL + IMAGE_TOKENS
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=special, initial_alphabet=alphabet))
  tok.save(os.path.join(directory, "tokenizer.json"))
  cfg = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": CHATML}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)


def main(argv: list[str]) -> None:
  out = argv[1] if len(argv) > 1 else "tiny_vision"
  hf_dir = os.path.join(out, "hf")
  os.makedirs(hf_dir, exist_ok=True)
  rows = []
  for colour, rgb in COLOURS.items():
    path = os.path.abspath(os.path.join(out, f"{colour}.png"))
    Image.fromarray(np.full((48, 40, 3), rgb, np.uint8)).save(path)
    for q in QUESTIONS:
      user = {"role": "user", "content": "<start_of_image>" + q}
      rows.append({"messages": [user, {"role": "assistant", "content": colour.capitalize() + "."}], "images": [path]})
  write_tokenizer(hf_dir, [m["content"] for r in rows for m in r["messages"]] * 4)
  write_model(hf_dir)
  with open(os.path.join(out, "chat.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"Wrote {hf_dir}, {len(COLOURS)} images and {os.path.join(out, 'chat.jsonl')} ({len(rows)} conversations)")


if __name__ == "__main__":
  main(sys.argv)
