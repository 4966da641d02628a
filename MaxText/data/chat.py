"""Chat and instruction examples -> token ids with a loss mask, for supervised fine-tuning (use_sft=true).

A record (a .jsonl line, a .parquet or Hugging Face dataset row) holds a conversation: a `sft_messages_column`
list of {"role", "content"} messages, or `sft_prompt_column` + `sft_completion_column` (strings: one user and
one assistant turn; or lists of messages). It is rendered with a chat template the way Hugging Face
transformers renders it (Jinja2, sandboxed, trim_blocks and lstrip_blocks, the tokenizer's special tokens as
variables), tokenized once, and each token is marked as completion (it carries loss) or prompt (no loss).

A record whose prompt and completion are both strings, read without a chat template (the tokenizer has none and
sft_chat_template is empty, or the tokenizer is SentencePiece or tiktoken, which render no template), is plain
text: its ids are BOS (add_bos), the prompt's, the completion's, EOS (add_eos), each part tokenized on its own as
other trainers do for their standard (non-conversational) format (tokenize_plain). A conversation (messages) needs a
chat template: a Hugging Face tokenizer's, or this module's default one.

The completion is every assistant turn (with prompt/completion columns: the assistant turns of the
completion only). Its character spans come from the template's `{% generation %}` markers when it has them;
otherwise, for assistant message i, span = what rendering messages[:i + 1] adds to rendering messages[:i]
with the generation prompt, so it holds the reply and the template's end-of-turn token but not the header.
That needs a template that renders a conversation's prefixes as prefixes of the whole; one that does not
(e.g. one that rewrites earlier turns) is refused with a DataError: give sft_chat_template instead.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from MaxText.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
# Used when the tokenizer has no chat template and sft_chat_template is empty (documented in docs/sft.md):
#   <bos>User: question\nAssistant: answer<eos>\nUser: ...
DEFAULT_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
  "{% if m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token }}"
  "{% else %}{{ m['role'] | capitalize + ': ' + m['content'] }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}{% if messages %}{{ '\\n' }}{% endif %}{{ 'Assistant: ' }}{% endif %}"
)
# Wrapped around the output of a {% generation %} block while rendering, then removed: private-use characters
# that no real text holds.
GEN_START, GEN_END = "\ue000", "\ue001"


class Conversation(NamedTuple):
  messages: list[dict[str, Any]]  # each with a str "role" (one of ROLES) and a str "content"
  first_trained: int  # assistant messages from this index on are the completion


class Example(NamedTuple):
  tokens: np.ndarray  # int32 [n]: the rendered conversation's token ids
  loss_mask: np.ndarray  # uint8 [n]: 1 for the tokens of the completion (they carry loss), 0 for the prompt


def _generation_extension():
  """A Jinja2 extension for transformers' `{% generation %}...{% endgeneration %}`: marks what it renders."""
  import jinja2.ext
  import jinja2.nodes

  class Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      return GEN_START + caller() + GEN_END

  return Generation


def _raise_exception(message: str) -> None:
  raise DataError(f"The chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
  """A compiled chat template and the special tokens it may name (bos_token, eos_token, ...)."""

  def __init__(self, source: str, special_tokens: dict[str, Any], where: str, default: bool = False):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateError as e:
      raise DataError(
        f"The chat template of {where} is not valid Jinja2: {e}; fix it or set sft_chat_template"
      ) from None
    self.source, self.where, self.special_tokens = source, where, dict(special_tokens)
    self.default = default  # DEFAULT_TEMPLATE, used since no template was found: string rows are plain text

  def render_marked(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """The template's text, with GEN_START/GEN_END around `{% generation %}` output."""
    import jinja2

    try:
      # tools/documents None as transformers passes them when not given (templates test `is not none`).
      return self._template.render(
        messages=list(messages),
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **self.special_tokens,
      )
    except jinja2.TemplateError as e:
      raise DataError(f"The chat template of {self.where} failed: {type(e).__name__}: {e}") from None

  def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """The conversation as text (what transformers' apply_chat_template(tokenize=False) returns)."""
    return self.render_marked(messages, add_generation_prompt).replace(GEN_START, "").replace(GEN_END, "")


def _read_json(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise DataError(f"Cannot read {path!r}: {e}") from None


def load_template(tok: Any, override: str = "") -> ChatTemplate:
  """The chat template of a Hugging Face tokenizer `tok`: the file `override` (sft_chat_template) if set, else
  tokenizer_config.json's `chat_template` or chat_template.jinja next to tok.path, else DEFAULT_TEMPLATE.
  Special-token variables come from tokenizer_config.json, with bos_token/eos_token filled in from `tok`.
  A SentencePiece or tiktoken tokenizer renders no template (no encode_with_offsets): DEFAULT_TEMPLATE, unused."""
  if not hasattr(tok, "encode_with_offsets"):
    return ChatTemplate(DEFAULT_TEMPLATE, {}, "the default template", default=True)
  directory = os.path.dirname(tok.path)
  cfg_path = os.path.join(directory, "tokenizer_config.json")
  cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
  specials = {}
  for key, value in cfg.items():
    if key.endswith("_token") and isinstance(value, (str, dict)):
      specials[key] = value.get("content", "") if isinstance(value, dict) else value
  for key, token_id in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
    specials[key] = specials.get(key) or tok.token_text(token_id)
  source, where = cfg.get("chat_template"), cfg_path
  if isinstance(source, list):  # several named templates: the default one
    source = next((t.get("template") for t in source if t.get("name") == "default"), None)
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if override:
    source, where = _read_text(override, "sft_chat_template"), override
  elif not source and os.path.isfile(jinja_path):
    source, where = _read_text(jinja_path, "chat_template.jinja"), jinja_path
  elif not source:
    return ChatTemplate(DEFAULT_TEMPLATE, specials, "the default template (docs/sft.md)", default=True)
  return ChatTemplate(source, specials, where)


def _read_text(path: str, what: str) -> str:
  try:
    with open(os.path.expanduser(path), encoding="utf-8") as f:
      return f.read()
  except OSError as e:
    raise DataError(f"Cannot read the chat template {what}={path!r}: {e.strerror}") from None


class Columns(NamedTuple):
  messages: str  # sft_messages_column
  prompt: str  # sft_prompt_column
  completion: str  # sft_completion_column


def conversation(record: Any, columns: Columns, where: str) -> Conversation:
  """The Conversation of one record (a dict); DataError naming `where` when its columns, roles or contents are
  not usable or it has no assistant turn to train on."""
  if not isinstance(record, dict):
    raise DataError(f"{where} is a {type(record).__name__}, not an object with a {columns.messages!r} field")
  if record.get(columns.messages) is not None:
    messages, first = _messages(record[columns.messages], columns.messages, where), 0
  elif record.get(columns.prompt) is not None and record.get(columns.completion) is not None:
    prompt = _turns(record[columns.prompt], "user", columns.prompt, where)
    messages, first = prompt + _turns(record[columns.completion], "assistant", columns.completion, where), len(prompt)
  else:
    raise DataError(
      f"{where} has neither a {columns.messages!r} column nor {columns.prompt!r} and {columns.completion!r} columns "
      f"(it has {', '.join(map(repr, record)) or 'none'}); set sft_messages_column or sft_prompt_column and "
      "sft_completion_column"
    )
  if not any(m["role"] == "assistant" for m in messages[first:]):
    raise DataError(f"{where} has no assistant turn to train on; every example needs an assistant reply")
  return Conversation(messages, first)


def plain(record: Any, columns: Columns) -> tuple[str, str] | None:
  """(prompt, completion) of a record without a messages column whose prompt and completion are strings, else
  None (a conversation)."""
  if not isinstance(record, dict) or record.get(columns.messages) is not None:
    return None
  prompt, completion = record.get(columns.prompt), record.get(columns.completion)
  return (prompt, completion) if isinstance(prompt, str) and isinstance(completion, str) else None


def _turns(value: Any, role: str, column: str, where: str) -> list[dict[str, Any]]:
  """A prompt/completion column: a string (one `role` message) or a list of messages."""
  if isinstance(value, str):
    return [{"role": role, "content": value}]
  return _messages(value, column, where, "a string or a non-empty list of {'role', 'content'} messages")


def _messages(
  value: Any, column: str, where: str, expected: str = "a non-empty list of {'role', 'content'} messages"
) -> list[dict[str, Any]]:
  if isinstance(value, str):  # a JSON-encoded list, as some exports store it
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      pass
  if not isinstance(value, (list, tuple)) or not value:
    raise DataError(f"{where}: {column!r} must be {expected}")
  out = []
  for i, m in enumerate(value):
    if not isinstance(m, dict):
      raise DataError(f"{where}: {column!r} must be {expected}; its item {i} is {m!r:.40}, not a message")
    if m.get("role") not in ROLES:
      raise DataError(f"{where}: {column!r} message {i} has role {m.get('role')!r}; roles are {', '.join(ROLES)}")
    content = "" if m.get("content") is None else m["content"]
    if not isinstance(content, str):
      raise DataError(f"{where}: {column!r} message {i} has a {type(content).__name__} content; it must be a string")
    out.append({**{k: v for k, v in m.items() if v is not None}, "content": content})
  return out


def completion_spans(template: ChatTemplate, conv: Conversation, where: str) -> tuple[str, list[tuple[int, int]]]:
  """(the rendered conversation, the [start, end) character spans of its completion), see the module doc."""
  messages = conv.messages
  marked = template.render_marked(messages)
  if GEN_START in marked:
    pieces = marked.replace(GEN_END, GEN_START).split(GEN_START)  # odd pieces: inside {% generation %}
    starts = np.cumsum([0] + [len(p) for p in pieces]).tolist()
    spans = [(starts[i], starts[i + 1]) for i in range(1, len(pieces), 2)]
    if conv.first_trained:  # only the completion's turns: drop spans inside the rendered prompt
      prompt_end = len(template.render(messages[: conv.first_trained], add_generation_prompt=True))
      spans = [s for s in spans if s[0] >= prompt_end]
    return "".join(pieces), spans
  full, spans = marked, []
  for i in range(conv.first_trained, len(messages)):
    if messages[i]["role"] != "assistant":
      continue
    before = template.render(messages[:i], add_generation_prompt=True)
    after = template.render(messages[: i + 1])
    if not (after.startswith(before) and full.startswith(after)):
      raise DataError(
        f"{where}: the chat template of {template.where} does not render the conversation up to message {i} as a "
        "prefix of the whole, so its assistant turns cannot be located; set sft_chat_template to a template that "
        "does (or one with {% generation %} markers)"
      )
    spans.append((len(before), len(after)))
  return full, spans


def tokenize(
  template: ChatTemplate, tok: Any, conv: Conversation, completion_only: bool, where: str, rewrite: Any = None
) -> Example:
  """The Example of `conv`: tokens of the rendered text (as the tokenizer splits the whole text) and their loss
  mask; a token belongs to the completion when its first character does. rewrite(text) -> (text, map of
  positions), when given, changes the rendered text first (data/images.processor_text)."""
  if not hasattr(tok, "encode_with_offsets"):
    raise DataError(
      f"{where} is a conversation (a list of messages), which needs a chat template, and the tokenizer "
      f"{tok.path!r} has none (only tokenizer_type=huggingface has one): give 'prompt' and the reply as strings"
    )
  try:
    text, spans = completion_spans(template, conv, where)
  except DataError as e:  # a template failure names the template; say which example too
    raise (e if str(e).startswith(where) else DataError(f"{where}: {e}")) from None
  if rewrite is not None:
    text, move = rewrite(text)
    spans = [(move(start), move(end)) for start, end in spans]
  ids, offsets = tok.encode_with_offsets(text)
  starts = np.array([o[0] for o in offsets], np.int64)
  mask = np.zeros(len(ids), np.uint8)
  for start, end in spans:
    mask[(starts >= start) & (starts < end)] = 1
  if completion_only and not mask.any():
    raise DataError(f"{where}: the assistant turns render to no tokens; check the chat template")
  return Example(np.array(ids, np.int32), mask if completion_only else np.ones_like(mask))


def tokenize_plain(
  tok: Any, text: tuple[str, str], ends: tuple[bool, bool], completion_only: bool, where: str, rewrite: Any = None
) -> Example:
  """The Example of a plain (prompt, completion): BOS if ends[0] (and the tokenizer has one), the prompt's ids,
  the completion's ids, EOS if ends[1]; loss on the completion and its EOS. rewrite(text) -> (text, map), when
  given, changes the prompt first (data/images.processor_text)."""
  prompt, completion = text
  if rewrite is not None:
    prompt = rewrite(prompt)[0]
  head = ([tok.bos_id] if ends[0] and tok.bos_id >= 0 else []) + list(tok.encode(prompt))
  tail = list(tok.encode(completion)) + ([tok.eos_id] if ends[1] and tok.eos_id >= 0 else [])
  if not tail:
    raise DataError(f"{where}: the completion is empty and add_eos=false: nothing to train on")
  mask = np.concatenate([np.full(len(head), 0 if completion_only else 1, np.uint8), np.ones(len(tail), np.uint8)])
  return Example(np.array(head + tail, np.int32), mask)
