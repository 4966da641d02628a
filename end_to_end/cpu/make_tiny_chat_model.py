"""A tiny Hugging Face Llama with a chat tokenizer, and a chat .jsonl to fine-tune it on (for end_to_end/cpu/sft.sh).

    python3 end_to_end/cpu/make_tiny_chat_model.py OUT_DIR

Writes OUT_DIR/hf (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML
chat_template) and OUT_DIR/chat.jsonl (one {"messages": [...]} conversation per line). The model is random
(what a Hugging Face download would be, only ~140K parameters); its shape is the one MaxText/configs/cpu/sft.yml
names. Offline and without torch: numpy draws the weights as transformers initialises a LlamaForCausalLM (normal,
std 0.02; norms 1), safetensors writes them, tokenizers trains the tokenizer.
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

CHATML = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Egypt": "Cairo", "Peru": "Lima"}
SYSTEM = "You answer with one word."
# The architecture of MaxText/configs/cpu/sft.yml (keep the two in step).
LLAMA = dict(
  hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
  head_dim=16, vocab_size=512, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
  tie_word_embeddings=False,
)  # fmt: skip


def conversations() -> list[dict]:
  """Every capital asked two ways, each a system + user + assistant conversation."""
  out = []
  for country, capital in CAPITALS.items():
    for question in (f"What is the capital of {country}?", f"Name the capital of {country}."):
      turns = [("system", SYSTEM), ("user", question), ("assistant", f"{capital}.")]
      out.append({"messages": [{"role": r, "content": c} for r, c in turns]})
  return out


def llama_config() -> dict:
  """config.json of a LlamaForCausalLM of shape LLAMA, with the keys transformers writes."""
  rope = {"rope_theta": LLAMA["rope_theta"], "rope_type": "default"}
  keys = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
  fixed = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=None)
  fixed |= dict(hidden_act="silu", initializer_range=0.02, mlp_bias=False, pretraining_tp=1, use_cache=True)
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32", "rope_parameters": rope,
          **fixed, **keys}  # fmt: skip


def llama_weights(seed: int = 0) -> dict[str, np.ndarray]:
  """Random LlamaForCausalLM weights of shape LLAMA, by their Hugging Face names."""
  rng = np.random.default_rng(seed)
  h, i, d = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["head_dim"]
  q, kv = LLAMA["num_attention_heads"] * d, LLAMA["num_key_value_heads"] * d
  shapes = {"model.embed_tokens.weight": (LLAMA["vocab_size"], h)}
  for n in range(LLAMA["num_hidden_layers"]):
    at, mlp = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
    shapes |= {at + "q_proj.weight": (q, h), at + "k_proj.weight": (kv, h), at + "v_proj.weight": (kv, h)}
    shapes |= {at + "o_proj.weight": (h, q), mlp + "gate_proj.weight": (i, h), mlp + "up_proj.weight": (i, h)}
    shapes |= {mlp + "down_proj.weight": (h, i)}
    shapes |= {f"model.layers.{n}.{norm}.weight": (h,) for norm in ("input_layernorm", "post_attention_layernorm")}
  shapes |= {"model.norm.weight": (h,), "lm_head.weight": (LLAMA["vocab_size"], h)}
  return {
    name: np.ones(shape, np.float32) if len(shape) == 1 else rng.normal(0.0, 0.02, shape).astype(np.float32)
    for name, shape in shapes.items()
  }


def write_model(directory: str) -> None:
  """config.json and model.safetensors, as LlamaForCausalLM.save_pretrained writes them."""
  save_file(llama_weights(), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(llama_config(), f, indent=2, sort_keys=True)


def write_tokenizer(directory: str, texts: list[str]) -> None:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=LLAMA["vocab_size"], special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(texts, trainer)
  tok.save(os.path.join(directory, "tokenizer.json"))
  cfg = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": CHATML}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first): OUT_DIR."""
  if len(argv) != 2:
    raise SystemExit(__doc__.split("\n\n")[1].strip())
  out = argv[1]
  hf_dir = os.path.join(out, "hf")
  os.makedirs(hf_dir, exist_ok=True)
  write_model(hf_dir)
  data = conversations()
  texts = [m["content"] for c in data for m in c["messages"]]
  write_tokenizer(hf_dir, texts * 4)
  with open(os.path.join(out, "chat.jsonl"), "w") as f:
    f.writelines(json.dumps(c) + "\n" for c in data)
  print(f"Wrote {hf_dir} and {os.path.join(out, 'chat.jsonl')} ({len(data)} conversations)")


if __name__ == "__main__":
  main(sys.argv)
