"""OpenAI's Responses API, its core (`POST /v1/responses`), over the chat path: pure functions, no HTTP.

A Responses request is a chat request in other words: `input` (a string, or items: messages, function calls and their
outputs) and `instructions` become chat messages, flat function `tools` become chat tools, `text.format` a
response_format, `max_output_tokens` max_tokens. So everything the chat path does (the template, tools and their
grammar, structured output, the prefix cache, log-probabilities) holds here unchanged. The answer's text and calls become
output items, streamed as OpenAI's event sequence (docs/serving.md#the-responses-api). Nothing is stored: `store: true`
and `previous_response_id` are refused by name (a client sends the whole conversation as `input`, as the Agents SDK
does); so is every field this module does not name.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any

from pyruntime import errors
from pyruntime.params import SAMPLING
from pyruntime.serving.openai_api import ParsedRequest, TokenText, error_body
from pyruntime.serving.request_fields import CHAT, RESPONSES, check_body
from pyruntime.serving.request_fields import dump as _dump

# its fields (the core, the chat path's sampling fields, fields that ask for nothing we would have to do: metadata and
# user are echoed, prompt_cache_key and safety_identifier are hints; store and the rest at their neutral values):
# pyruntime/serving/request_fields.py
_LOGPROBS = "message.output_text.logprobs"


def parse(body: dict[str, Any]) -> ParsedRequest:
  """A Responses request as the chat path's ParsedRequest (kind RESPONSES); InvalidOption / UnsupportedFeature naming
  the field (`input[2].type`, `text.format.type`, ...)."""
  from pyruntime.serving.openai_api import parse_request
  check_body(body, RESPONSES)
  chat: dict[str, Any] = {k: body[k] for k in ("model", "parallel_tool_calls", "stream", "user", *SAMPLING) if body.get(k) is not None}
  chat["messages"], origins = messages(body.get("input"), body.get("instructions"))
  if body.get("max_output_tokens") is not None: chat["max_tokens"] = body["max_output_tokens"]
  if body.get("tools") is not None: chat["tools"] = tools(body["tools"])
  if body.get("tool_choice") is not None: chat["tool_choice"] = tool_choice(body["tool_choice"])
  if (fmt := text_format(body.get("text"))) is not None: chat["response_format"] = fmt
  include = body.get("include") or []
  for i, what in enumerate(include):
    if what != _LOGPROBS: raise errors.UnsupportedFeature(f"include[{i}]", f"pyruntime can include only {_LOGPROBS!r}, not {_dump(what)}")
  k = body.get("top_logprobs")
  if include or k: chat["logprobs"], chat["top_logprobs"] = True, k or 0
  check_metadata(body.get("metadata"))
  try: req = parse_request(chat, CHAT)
  except (errors.InvalidOption, errors.UnsupportedFeature) as e: raise own_names(e, origins) from None
  req.kind, req.origins = RESPONSES, origins
  return req


MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's rule for `metadata`


def check_metadata(meta: Any) -> None:
  """OpenAI's rule: at most 16 pairs of a key of at most 64 characters and a string value of at most 512. So what is
  echoed back is flat: no nesting reaches the JSON renderer."""
  if meta is None: return
  if not isinstance(meta, dict): raise errors.InvalidOption("metadata", "must be an object")
  if len(meta) > MAX_METADATA_KEYS: raise errors.InvalidOption("metadata", f"at most {MAX_METADATA_KEYS} keys, got {len(meta)}")
  for k, v in meta.items():
    if len(k) > MAX_METADATA_KEY: raise errors.InvalidOption("metadata", f"a key of {len(k)} characters: at most {MAX_METADATA_KEY}")
    if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE:
      raise errors.InvalidOption("metadata", f"the value of {_dump(k)} must be a string of at most {MAX_METADATA_VALUE} characters, got {_dump(v)}")


# the chat path's field names for what a Responses request calls otherwise
_CHAT_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
               "prompt": "input"}
_MESSAGE_FIELD = re.compile(r"^messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?(.*)$")
_CALL_KEYS = {".function.arguments": ".arguments", ".function.name": ".name", ".function": "", ".id": ".call_id"}
_ITEM_KEYS = {".tool_call_id": ".call_id"}


def own_name(field: str, origins: list[Origin] | None) -> str:
  """A chat-path field name (`messages[3].tool_calls[0].function.arguments`, `response_format.x`) as this request names
  it (`input[4].arguments`, `text.format.x`): `origins` says which item of `instructions`/`input` each message, and
  each of its calls, came from (calls in a row are merged into one message, instructions come first)."""
  if field in _CHAT_NAMES: return _CHAT_NAMES[field]
  if field.startswith("response_format.json_schema"): return "text.format" + field.removeprefix("response_format.json_schema")
  if field.startswith("response_format"): return "text.format" + field.removeprefix("response_format")
  if not (m := _MESSAGE_FIELD.match(field)): return field
  k, call, rest = int(m[1]), m[2], m[3]
  if origins is None or k >= len(origins): return "input"
  item, calls, role = origins[k]
  if item in ("instructions", "input"): return item  # one string: no deeper path
  if call is not None: return calls[int(call)] + _CALL_KEYS.get(rest, rest) if int(call) < len(calls) else item
  if role == "tool" and rest == ".content": rest = ".output"
  return item + _ITEM_KEYS.get(rest, rest)


def own_names(e: errors.InvalidOption | errors.UnsupportedFeature, origins: list[Origin] | None) -> errors.PyruntimeError:
  """The chat path's error `e`, naming this request's own field."""
  if isinstance(e, errors.InvalidOption):
    name = own_name(e.field, origins)
    return e if name == e.field else errors.InvalidOption(name, str(e).removeprefix(f"invalid {e.field!r}: "))
  name = own_name(e.feature, origins)
  return e if name == e.feature else errors.UnsupportedFeature(name, str(e).removeprefix(f"{e.feature!r} is not supported: "))


def _text(content: Any, where: str) -> str:
  """A message's content: a string, or parts of text (input_text, output_text; images and files refused by name)."""
  if isinstance(content, str): return content
  if not isinstance(content, list): raise errors.InvalidOption(where, "must be a string or a list of content parts")
  texts = []
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_image", "input_file", "input_audio"):
      raise errors.UnsupportedFeature(f"{where}[{j}].type={kind}", "pyruntime serves text-only models")
    if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
      raise errors.InvalidOption(f"{where}[{j}]", "must be {'type': 'input_text', 'text': ...}")
    texts.append(part["text"])
  return "\n".join(texts)


Origin = tuple[str, list[str], str]  # where a chat message came from: its item ("input[2]"), each call's item, its role


def messages(input_: Any, instructions: Any) -> tuple[list[dict[str, Any]], list[Origin]]:
  """`instructions` and `input` as chat messages, and where each came from: a function_call item joins the assistant turn
  before it (calls in a row are one turn's parallel calls), a function_call_output item is a tool message."""
  out: list[dict[str, Any]] = []
  origins: list[Origin] = []
  if instructions is not None:
    if not isinstance(instructions, str): raise errors.InvalidOption("instructions", "must be a string")
    out.append({"role": "system", "content": instructions})
    origins.append(("instructions", [], "system"))
  if isinstance(input_, str): return [*out, {"role": "user", "content": input_}], [*origins, ("input", [], "user")]
  if not isinstance(input_, list) or not input_: raise errors.InvalidOption("input", "must be a string or a non-empty list of items")
  for i, item in enumerate(input_):
    where = f"input[{i}]"
    if not isinstance(item, dict): raise errors.InvalidOption(where, "must be an object")
    kind = item.get("type", "message")
    if kind == "message":
      role = item.get("role")
      if role not in ("user", "assistant", "system", "developer"):
        raise errors.InvalidOption(f"{where}.role", f"must be user, assistant, system or developer, got {_dump(role)}")
      out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), f"{where}.content")})
      origins.append((where, [], role))
    elif kind == "function_call":
      for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str): raise errors.InvalidOption(f"{where}.{key}", "must be a string")
      call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
      if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None: out[-1]["tool_calls"].append(call)
      elif out and out[-1]["role"] == "assistant": out[-1]["tool_calls"] = [call]  # the text of the same turn before its calls
      else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        origins.append((where, [], "assistant"))
      origins[-1][1].append(where)
    elif kind == "function_call_output":
      if not isinstance(item.get("call_id"), str): raise errors.InvalidOption(f"{where}.call_id", "must be a string")
      out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"{where}.output")})
      origins.append((where, [], "tool"))
    else: raise errors.UnsupportedFeature(f"{where}.type={kind}", "pyruntime takes messages, function_call and function_call_output items")
  return out, origins


def tools(ts: Any) -> list[dict[str, Any]]:
  """Responses' flat function tools in the chat shape (checked there, by pyruntime/text/tools.py)."""
  if not isinstance(ts, list): raise errors.InvalidOption("tools", "must be a list of {'type': 'function', 'name': ...}")
  out = []
  for i, t in enumerate(ts):
    if not isinstance(t, dict) or t.get("type") != "function":
      got = _dump(t.get("type") if isinstance(t, dict) else t)
      raise errors.UnsupportedFeature(f"tools[{i}].type", f"pyruntime serves function tools, got {got}")
    out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}})
  return out


def tool_choice(choice: Any) -> Any:
  if isinstance(choice, dict) and choice.get("type") == "function": return {"type": "function", "function": {"name": choice.get("name")}}
  if isinstance(choice, dict):
    raise errors.UnsupportedFeature("tool_choice", f"pyruntime takes auto, none, required or a function, got {_dump(choice)}")
  return choice


def text_format(text: Any) -> dict[str, Any] | None:
  """`text.format` as a chat response_format: text (None), json_object, json_schema."""
  if text is None: return None
  if not isinstance(text, dict): raise errors.InvalidOption("text", "must be an object like {'format': {'type': 'text'}}")
  for key, v in text.items():
    if key not in ("format", "verbosity") or (key == "verbosity" and v not in (None, "medium")): raise errors.UnsupportedFeature(f"text.{key}")
  fmt = text.get("format")
  if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"): return None
  if not isinstance(fmt, dict): raise errors.InvalidOption("text.format", "must be an object with a type")
  if fmt.get("type") == "json_object": return {"type": "json_object"}
  if fmt.get("type") != "json_schema":
    raise errors.InvalidOption("text.format.type", f"must be text, json_object or json_schema, got {_dump(fmt.get('type'))}")
  return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


# --- the answer ---------------------------------------------------------------------------------------
class ResponsesShaper:
  """One request's Response object, or its stream of events (the same ids in both: a streamed client checks them)."""
  include_usage = False
  done_marker = b""  # the stream ends with response.completed, no [DONE]

  def __init__(self, req: ParsedRequest, body: dict[str, Any], model: str, tokenizer: Any = None):
    self.id, self.created, self.model, self.body = f"resp_{uuid.uuid4().hex}", int(time.time()), model, body
    self.logprobs = req.logprobs
    self.held: list[dict[str, Any]] = []  # streamed logprobs entries of tokens that brought no text yet
    self.spell = TokenText(tokenizer) if tokenizer is not None else None
    self.seq = 0
    self.items: list[dict[str, Any]] = []  # output items so far (streaming); the open message is the last while open
    self.open: dict[str, Any] | None = None

  def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
    b = self.body
    return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": reason} if reason else None, "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"), "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False,
            "temperature": b.get("temperature", 1.0), "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [], "top_logprobs": b.get("top_logprobs") or 0,
            "top_p": b.get("top_p", 1.0), "truncation": "disabled", "user": b.get("user"), "metadata": b.get("metadata") or {},
            "usage": usage}

  def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
    ev = {"type": kind, "sequence_number": self.seq, **fields}
    self.seq += 1
    return ev

  def _entries(self, scores: list[Any] | None) -> list[dict[str, Any]]:
    return [self.spell.chat_entry(s) for s in scores or []] if self.logprobs else []

  # streaming: the same interface as openai_api's shapers (server.SSEResponse)
  def first_chunks(self, choices: int) -> list[dict[str, Any]]:
    r = self.envelope("in_progress", [])
    return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

  def delta_chunks(self, index: int, delta: Any) -> list[dict[str, Any]]:
    out, entries = [], self._entries(delta.logprobs)
    if not delta.text: self.held += entries  # a token that ends inside a character: its entry goes with the next text
    else:
      if self.open is None:
        self.open = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self.items.append(self.open)
        out.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(self.open, content=[])))
        out.append(self._event("response.content_part.added", item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.open["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
      part, entries, self.held = self.open["content"][0], self.held + entries, []
      part["text"] += delta.text
      part["logprobs"] += entries
      out.append(self._event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                             delta=delta.text, logprobs=entries))
    for call in delta.tool_calls:
      out += self._close_message()
      item = _call_item(call)
      self.items.append(item)
      i = len(self.items) - 1
      out += [self._event("response.output_item.added", output_index=i, item=dict(item, arguments="", status="in_progress")),
              self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=item["arguments"]),
              self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i, arguments=item["arguments"]),
              self._event("response.output_item.done", output_index=i, item=item)]
    return out

  def _close_message(self) -> list[dict[str, Any]]:
    if (m := self.open) is None: return []
    self.open, i, part = None, self.items.index(m), m["content"][0]
    part["logprobs"] += self.held  # the last tokens' entries, whose text never came (a character left incomplete)
    m["status"], self.held = "completed", []
    return [self._event("response.output_text.done", item_id=m["id"], output_index=i, content_index=0, text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", item_id=m["id"], output_index=i, content_index=0, part=part),
            self._event("response.output_item.done", output_index=i, item=m)]

  def final_chunks(self, index: int, done: Any) -> list[dict[str, Any]]:
    out = self._close_message()
    if not self.items: self.items.append(_message_item("", self.held))  # an empty answer is still a message
    status, reason = _status(done)
    out.append(self._event(f"response.{status}", response=self.envelope(status, self.items, usage(done), reason)))
    return out

  def error_chunks(self, e: BaseException) -> list[dict[str, Any]]:
    """A stream that failed: response.failed, its error as OpenAI's {code, message} (never a top-level "error" key,
    which the client reads as a broken stream rather than a failed response)."""
    r = self.envelope("failed", self.items)
    err = error_body(e, CHAT)[1]["error"]
    r["error"] = {"code": err.get("code") or "server_error", "message": err["message"]}
    return [self._event("response.failed", response=r)]

  def response(self, dones: list[Any]) -> dict[str, Any]:
    done = dones[0]
    items = []
    if done.text.strip() or not done.tool_calls: items.append(_message_item(done.text, self._entries(done.logprobs)))
    items += [_call_item(c) for c in done.tool_calls]
    status, reason = _status(done)
    return self.envelope(status, items, usage(done), reason)


def _status(done: Any) -> tuple[str, str | None]:
  """OpenAI's: an answer cut by max_output_tokens is incomplete (with the reason), any other end completed."""
  return ("incomplete", "max_output_tokens") if done.finish_reason == "length" else ("completed", None)


def _message_item(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
  return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
          "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(call: Any) -> dict[str, Any]:
  return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call.id, "name": call.name, "arguments": call.arguments,
          "status": "completed"}


def usage(done: Any) -> dict[str, Any]:
  u = done.usage
  return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens}, "output_tokens": u.completion_tokens,
          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u.prompt_tokens + u.completion_tokens}
