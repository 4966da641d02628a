"""Print the chat-template prompt for one user message, to give decode.py a fine-tuned model's input format.

    python3 -m MaxText.data.chat_prompt TOKENIZER "What is the capital of Japan?" [TEMPLATE.jinja]

TOKENIZER: a tokenizer.json or its directory (a converted checkpoint's directory holds one, with the
tokenizer_config.json that carries the chat template). The text is written without a final newline of its
own, so a shell keeps it exact with `IFS= read -r -d '' PROMPT < <(python3 -m MaxText.data.chat_prompt ...)`.
The template usually starts with the BOS token's text: decode it with add_bos=false.
"""

import sys

from MaxText.data import chat
from MaxText.data.tokenizer import load_tokenizer
from MaxText.errors import DataError


def main(argv: list[str]) -> None:
  """argv: sys.argv (the program name first)."""
  args = argv[1:]
  if len(args) not in (2, 3):
    raise SystemExit(__doc__.split("\n\n")[1].strip())
  try:
    template = chat.load_template(load_tokenizer(args[0], "huggingface"), args[2] if len(args) == 3 else "")
    sys.stdout.write(template.render([{"role": "user", "content": args[1]}], add_generation_prompt=True))
  except DataError as e:
    raise SystemExit(str(e)) from None


if __name__ == "__main__":
  main(sys.argv)
