"""Prompt rendering: the GGUF's own chat template, fallbacks by tokenizer family, raw mode (docs/serving.md#prompt-rendering).

Templates are rendered the way Hugging Face transformers renders them (sandboxed jinja2,
trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII)
because that is the environment model authors write them for.
"""
from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyruntime.errors import ContextLengthExceeded, EmptyPrompt, InvalidOption, UnsupportedFeature
from pyruntime.text.tokenizer import Tokenizer
from pyruntime.text.tools import CallFormat, ToolRequest, check_tool_calls, fallback_messages, format_of

ROLES = ("system", "user", "assistant", "tool")
_UNSUPPORTED_PARTS = ("image_url", "input_audio", "file", "image", "audio")


# --- messages ---------------------------------------------------------------------------------
def validate_messages(messages: Any) -> list[dict[str, Any]]:
  """OpenAI-style messages as plain {role, content[, name, tool_call_id, tool_calls]} dicts with str content (an
  assistant's tool calls with their arguments decoded, as chat templates expect them; its content may then be null).

  Errors name the offending field, e.g. InvalidOption('messages[1].content')."""
  if not isinstance(messages, (list, tuple)): raise InvalidOption("messages", "must be a list of messages")
  if not messages: raise InvalidOption("messages", "at least one message is required")
  out: list[dict[str, Any]] = []
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(m, Mapping): raise InvalidOption(where, "must be an object with 'role' and 'content'")
    role = m.get("role")
    if role == "developer": role = "system"   # OpenAI's newer name for the system role
    if role not in ROLES: raise InvalidOption(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    for key, value in m.items():
      if key not in ("role", "content", "name", "tool_call_id", "tool_calls") and value is not None:
        raise UnsupportedFeature(f"{where}.{key}")
    calls = m.get("tool_calls")
    if calls and role != "assistant": raise InvalidOption(f"{where}.tool_calls", "only an assistant message carries tool calls")
    content = m.get("content")
    msg: dict[str, Any] = {"role": role, "content": "" if content is None and calls else _content(content, f"{where}.content")}
    if calls: msg["tool_calls"] = check_tool_calls(calls, f"{where}.tool_calls")
    for key in ("name", "tool_call_id"):
      if (v := m.get(key)) is not None:
        if not isinstance(v, str): raise InvalidOption(f"{where}.{key}", "must be a string")
        msg[key] = v
    out.append(msg)
  return out


def _content(content: Any, where: str) -> str:
  if isinstance(content, str): return content
  if content is None: raise InvalidOption(where, "is required")
  if not isinstance(content, (list, tuple)): raise InvalidOption(where, "must be a string or a list of text parts")
  texts = []
  for j, part in enumerate(content):
    if not isinstance(part, Mapping): raise InvalidOption(f"{where}[{j}]", "must be an object like {'type': 'text', 'text': ...}")
    kind = part.get("type")
    if kind in _UNSUPPORTED_PARTS: raise UnsupportedFeature(f"{where}[{j}].type={kind}", "pyruntime serves text-only models")
    if kind != "text": raise InvalidOption(f"{where}[{j}].type", f"must be 'text', got {kind!r}")
    if not isinstance(text := part.get("text"), str): raise InvalidOption(f"{where}[{j}].text", "must be a string")
    texts.append(text)
  # text parts are separate paragraphs of one message (llama.cpp's server joins them the same way)
  return "\n".join(texts)


# --- the jinja environment --------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; render the body."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


# --- built-in formats for GGUFs without a template --------------------------------------------
def _chatml(messages: list[dict[str, str]], add_generation_prompt: bool, bos: str) -> str:
  text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
  return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _llama3(messages: list[dict[str, str]], add_generation_prompt: bool, bos: str) -> str:
  text = bos + "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                       for m in messages)
  return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")


def _gemma(messages: list[dict[str, str]], add_generation_prompt: bool, bos: str) -> str:
  # Gemma 3's own template: turns of `user` and `model`; a system message's text, then a blank line, opens the first turn
  prefix = messages[0]["content"] + "\n\n" if messages and messages[0]["role"] == "system" else ""
  turns = messages[1:] if prefix else messages
  text = bos + "".join(f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n{prefix if i == 0 else ''}"
                       f"{m['content'].strip()}<end_of_turn>\n" for i, m in enumerate(turns))
  return text + ("<start_of_turn>model\n" if add_generation_prompt else "")


FALLBACKS = {"chatml": ("<|im_start|>", _chatml), "llama3": ("<|start_header_id|>", _llama3), "gemma": ("<start_of_turn>", _gemma)}


def _source_info(source: Tokenizer | Mapping[str, Any]) -> tuple[str | None, str, str, Any]:
  """(template, bos text, eos text, vocabulary membership test) from a Tokenizer or GGUF metadata."""
  if isinstance(source, Tokenizer):
    text = lambda i: source.token_text(i) if i is not None else ""
    return source.chat_template, text(source.bos_id), text(source.eos_id), lambda t: source.token_id(t) is not None
  tokens = source.get("tokenizer.ggml.tokens") or []
  def text_of(key: str) -> str:
    i = source.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[i] if i is not None and 0 <= i < len(tokens) else ""
  # a membership test asked at most for a marker or two: a scan, not a set of the whole vocabulary built per request
  return source.get("tokenizer.chat_template"), text_of("bos"), text_of("eos"), tokens.__contains__


def chat_format(source: Tokenizer | Mapping[str, Any]) -> str:
  """'gguf' when the model has its own template, else the fallback its vocabulary implies."""
  template, _, _, has = _source_info(source)
  if template: return "gguf"
  for name, (marker, _) in FALLBACKS.items():
    if has(marker): return name
  raise UnsupportedFeature("chat template", "the model has no tokenizer.chat_template and its vocabulary matches "
                           "no known chat format (ChatML, Llama 3, Gemma); send a raw prompt instead")


def tool_format(source: Tokenizer | Mapping[str, Any], template: str | None = None) -> tuple[CallFormat, bool] | None:
  """The family this model writes tool calls in, and whether its template renders tools itself (pyruntime/text/tools.py)."""
  own, _, _, has = _source_info(source)
  return format_of(template or own, has)


def require_tool_format(source: Tokenizer | Mapping[str, Any], template: str | None = None) -> tuple[CallFormat, bool]:
  """tool_format, or UnsupportedFeature("tools") for a model that cannot be given tools."""
  if (found := tool_format(source, template)) is None:
    raise UnsupportedFeature("tools", "the model's chat template renders no tools and is not ChatML (for the Hermes "
                             "convention): this model cannot be given tools")
  return found


def render_chat(source: Tokenizer | Mapping[str, Any], messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, template: str | None = None, tools: ToolRequest | None = None,
                **extra: Any) -> str:
  """The prompt text for `messages` in the model's chat format.

  `source` is a Tokenizer or the GGUF metadata dict; `template` overrides the GGUF's own; `tools` (checked by
  tools.check_tools) go to a template that renders tools, else into the system turn by the Hermes convention
  (docs/tools.md); `extra` variables (e.g. date_string) are passed to the template as Hugging Face does."""
  msgs = validate_messages(messages)
  own, bos, eos, _ = _source_info(source)
  template = template or own
  if tools is not None or any("tool_calls" in m for m in msgs):
    fmt, knows = require_tool_format(source, template)
    if knows: extra["tools"] = list(tools.tools) if tools is not None and tools.calls_allowed else None
    else: msgs = fallback_messages(msgs, tools, fmt)
  if not template:
    return FALLBACKS[chat_format(source)][1](msgs, add_generation_prompt, bos)
  try: compiled = _compile(template)
  except jinja2.TemplateSyntaxError as e:
    raise UnsupportedFeature("chat template", f"the model's chat template does not compile: {e}") from e
  try:
    # tools/documents are passed as None like transformers does: templates test `tools is not none`
    return compiled.render(**{"messages": msgs, "add_generation_prompt": add_generation_prompt, "bos_token": bos,
                              "eos_token": eos, "tools": None, "documents": None, **extra})
  except jinja2.TemplateError as e:   # raise_exception(...) in the template, undefined names, sandbox
    raise InvalidOption("messages", f"the chat template rejected the messages: {e}") from e
  except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
    raise InvalidOption("messages", f"the chat template failed on the messages: {e!r}") from e


def refuse_prompt_that_cannot_fit(tokenizer: Tokenizer, text: str, context_length: int | None) -> None:
  """Raise ContextLengthExceeded(at_least=True) when `text` is certain to need `context_length` tokens
  or more (leaving none to generate), found from its byte length alone: tokenizing megabytes only to
  refuse them would hold the CPU (and the GIL) for seconds. Text that might fit passes."""
  if context_length is None: return
  n = tokenizer.min_tokens(text)
  if n and tokenizer.add_bos and tokenizer.bos_id is not None: n += 1
  if n >= context_length: raise ContextLengthExceeded(n, context_length, at_least=True)


def _context_of(kv: Mapping[str, Any] | None) -> int | None:
  """The model's trained context from GGUF metadata, if it states one."""
  if kv is None: return None
  n = kv.get(f"{kv.get('general.architecture')}.context_length")
  return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def build_prompt_ids(tokenizer: Tokenizer, kv: Mapping[str, Any] | None = None, *, prompt: str | None = None,
                     messages: Sequence[Mapping[str, Any]] | None = None, raw: bool = False,
                     add_generation_prompt: bool = True, context_length: int | None = None,
                     tools: ToolRequest | None = None) -> list[int]:
  """Token ids of a request's prompt.

  messages, or a prompt without raw, go through the chat template (a prompt as one user message);
  raw encodes the prompt as is (special tokens in it parsed, BOS only where the GGUF asks for it), and so does a prompt
  to a model whose file has no chat template of its own: a base model, which continues text (llama.cpp's CLI runs such
  a file in completion mode too); messages to it take the fallback format its vocabulary implies.
  BOS appears once: a template that writes it as text gets it stripped and added as the id.
  Raises EmptyPrompt when nothing but BOS is left, and ContextLengthExceeded, before tokenizing, for
  text too long to fit `context_length` (default: the context the GGUF metadata states)."""
  if (prompt is None) == (messages is None): raise InvalidOption("prompt", "give exactly one of prompt and messages")
  if prompt is not None and not isinstance(prompt, str): raise InvalidOption("prompt", "must be a string")
  if context_length is None: context_length = _context_of(kv)
  if messages is None and not _source_info(kv if kv is not None else tokenizer)[0]: raw = True  # a base model
  if raw:
    if messages is not None: raise InvalidOption("raw", "raw applies to a prompt, not to messages")
    if tools is not None: raise InvalidOption("tools", "tools go into the chat template: not with raw=True")
    assert prompt is not None
    refuse_prompt_that_cannot_fit(tokenizer, prompt, context_length)
    ids = tokenizer.encode(prompt, parse_special=True)
  else:
    if messages is None: messages = [{"role": "user", "content": prompt}]
    try: text = render_chat(kv if kv is not None else tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except RecursionError:  # a tool call's arguments (or a tool's schema) nested deeper than the template's JSON goes
      raise InvalidOption("messages" if tools is None else "tools", "is nested too deeply to render") from None
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    if tokenizer.add_bos and bos and text.startswith(bos): text = text[len(bos):]
    refuse_prompt_that_cannot_fit(tokenizer, text, context_length)
    ids = tokenizer.encode(text, parse_special=True)
  if not ids: raise EmptyPrompt()
  if tokenizer.add_bos and tokenizer.bos_id is not None: ids = [tokenizer.bos_id, *ids]
  return ids
