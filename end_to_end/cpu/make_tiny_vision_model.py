"""A tiny random Hugging Face Gemma3ForConditionalGeneration (SigLIP tower, projector, Gemma 3 text model) with a
chat tokenizer, three solid-colour PNGs and a chat .jsonl about them (for end_to_end/cpu/multimodal.sh).

  python3 end_to_end/cpu/make_tiny_vision_model.py OUT_DIR

Writes OUT_DIR/hf (config.json, model.safetensors, tokenizer.json, tokenizer_config.json), OUT_DIR/{red,green,blue}.png
and OUT_DIR/chat.jsonl: one {"messages": [...], "images": [path]} row per line, the user turn starting with the
<start_of_image> marker (token 5) where the image goes; the reply names the colour.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from PIL import Image

import MaxText

MaxText.require_torch("make_tiny_vision_model.py (a tiny Hugging Face model)")
import torch  # noqa: E402
import transformers  # noqa: E402

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
  torch.manual_seed(0)
  cfg = transformers.Gemma3Config(
    text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=IMAGE,
    boi_token_index=BOI, eoi_token_index=EOI,
  )  # fmt: skip
  transformers.Gemma3ForConditionalGeneration(cfg).save_pretrained(hf_dir)
  with open(os.path.join(out, "chat.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"Wrote {hf_dir}, {len(COLOURS)} images and {os.path.join(out, 'chat.jsonl')} ({len(rows)} conversations)")


if __name__ == "__main__":
  main(sys.argv)
