"""Tool calls (docs/tools.md): OpenAI `tools` / `tool_choice` checked, the tools put in the prompt, the call decoded under
a grammar, and calls parsed out of the generated text by the model family's markers.

A family is a `CallFormat`: how a call is written in text (`render`), the grammar a call is decoded under, and how
calls are read back. Hermes (Qwen, Hermes, and the fallback for ChatML templates that know no tools) writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; Llama 3 answers with the call's JSON alone
(`{"name": ..., "parameters": {...}}`); DeepSeek V3.2 writes a DSML block (parsed only: its calls are XML-like, not
JSON, so no grammar of ours constrains them). `ToolCallParser` separates the stream's text into content and calls as
it arrives; an opening marker split over two tokens (or two deltas) is held back until it is whole or cannot be.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyruntime import errors

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for a function name ('.' too: namespaced tools are common)
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
  """One parsed call. `arguments` is JSON text, as OpenAI sends it."""
  id: str
  name: str
  arguments: str

  def to_openai(self) -> dict[str, Any]:
    return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call(name: str, arguments: Any) -> ToolCall:
  return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class ToolRequest:
  """A request's tools, checked: `tools` as the template sees them, parameters by name, and the choice."""
  tools: tuple[dict[str, Any], ...]
  parameters: dict[str, dict[str, Any]]
  choice: str            # "none" | "auto" | "required" | "function" (then `name` is the function)
  name: str | None = None
  parallel: bool = True

  @property
  def calls_allowed(self) -> bool: return self.choice != "none"


def _schema(params: Any, where: str) -> dict[str, Any]:
  if params is None: return {"type": "object", "properties": {}}
  if not isinstance(params, dict): raise errors.InvalidOption(where, "must be a JSON schema object")
  return params


def check_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
  """The checked tools of a request (None: no tools). InvalidOption naming the field for anything malformed."""
  if tools is None or tools == []:
    if tool_choice not in (None, "none"): raise errors.InvalidOption("tool_choice", "is only allowed when tools are given")
    return None
  if not isinstance(tools, (list, tuple)): raise errors.InvalidOption("tools", "must be a list of {'type': 'function', 'function': {...}}")
  if len(tools) > MAX_TOOLS: raise errors.InvalidOption("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
  out, params = [], {}
  for i, t in enumerate(tools):
    where = f"tools[{i}]"
    if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
      raise errors.InvalidOption(where, "must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
      raise errors.InvalidOption(f"{where}.function.name", f"must be 1-64 letters, digits, '_', '.' or '-', got {name!r:.80}")
    if name in params: raise errors.InvalidOption(f"{where}.function.name", f"{name!r} is given twice")
    if (d := f.get("description")) is not None and not isinstance(d, str):
      raise errors.InvalidOption(f"{where}.function.description", "must be a string")
    for key in f:
      if key not in ("name", "description", "parameters", "strict"): raise errors.UnsupportedFeature(f"{where}.function.{key}")
    params[name] = _schema(f.get("parameters"), f"{where}.function.parameters")
    fn = {"name": name, **({"description": d} if d is not None else {}), "parameters": params[name]}
    out.append({"type": "function", "function": fn})
  if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
    raise errors.InvalidOption("parallel_tool_calls", "must be true or false")
  choice, name = _choice(tool_choice, params)
  return ToolRequest(tuple(out), params, choice, name, parallel_tool_calls is not False)


def _choice(tool_choice: Any, params: Mapping[str, Any]) -> tuple[str, str | None]:
  if tool_choice is None: return "auto", None
  if tool_choice in ("none", "auto", "required"): return tool_choice, None
  if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), Mapping):
    name = tool_choice["function"].get("name")
    if name not in params: raise errors.InvalidOption("tool_choice", f"names no function in tools: {name!r:.80}")
    return "function", name
  raise errors.InvalidOption("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


def check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
  """An assistant message's `tool_calls`, arguments decoded to objects as chat templates expect them."""
  if not isinstance(calls, (list, tuple)): raise errors.InvalidOption(where, "must be a list of tool calls")
  out = []
  for i, c in enumerate(calls):
    w = f"{where}[{i}]"
    f = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
      raise errors.InvalidOption(w, "must be {'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': '...'}}")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
      try: args = json.loads(args or "{}")
      except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise errors.InvalidOption(f"{w}.function.arguments", "must be a JSON object (as text) that is not nested thousands deep") from None
    if not isinstance(args, dict): raise errors.InvalidOption(f"{w}.function.arguments", "must be a JSON object (as text)")
    out.append({"id": str(c.get("id") or ""), "type": "function", "function": {"name": f["name"], "arguments": args}})
  return out


# --- families -----------------------------------------------------------------------------------------------------
def _call_schema(req: ToolRequest, key: str) -> dict[str, Any]:
  """The JSON schema of one call: {"name": <a function>, key: <its parameters>}, the name first."""
  from pyruntime.text.grammar import JSON_OPTIONS, closed
  names = [req.name] if req.choice == "function" else list(req.parameters)
  # the client's argument schema closed too (grammar.closed), not only the wrapper: no keys the function never named
  one = [{"type": "object", "properties": {"name": {"const": n}, key: closed(req.parameters[n])}, "required": ["name", key],
          "additionalProperties": False} for n in names]
  # compact JSON (no free whitespace between tokens: a weak model would spend its budget on blanks), as grammar.py's
  return (one[0] if len(one) == 1 else {"anyOf": one}) | {"x-guidance": JSON_OPTIONS}


def _lit(tok: Any, marker: str) -> str:
  """A marker in a Lark grammar: the token by id where the vocabulary has it as one special token (the model writes that
  token, not the marker's letters), else the text."""
  if (i := tok.token_id(marker)) is not None and tok.token_type(i) != 1: return f"<[{i}]>"
  return json.dumps(marker)


class CallFormat:
  """Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""
  name, open, close, key = "hermes", "<tool_call>", "</tool_call>", "arguments"
  constrained = True

  def render(self, calls: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(f'{self.open}\n{json.dumps({"name": c["function"]["name"], self.key: c["function"]["arguments"]}, ensure_ascii=False)}'
                     f"\n{self.close}" for c in calls)

  def grammar(self, req: ToolRequest, tok: Any) -> str:
    """Lark for llguidance: under `required` or a named function the answer is the call(s); under `auto` free text,
    until the opening marker appears (a lazy lexeme), then a whole call."""
    op, cl = _lit(tok, self.open), _lit(tok, self.close)
    body = f'"\\n"? %json {json.dumps(_call_schema(req, self.key))} "\\n"? {cl}'
    more = f'\nmore: "\\n"? {op} {body}' if req.parallel and req.choice != "function" else ""
    rest = " more*" if more else ""
    if req.choice != "auto" and not more:
      # one forced call: the answer is over when its JSON closes (the closing marker would only spend the budget: the
      # parser takes an unclosed call whose JSON is whole, and a history renders calls from tool_calls, not this text)
      return f'%llguidance {{}}\nstart: {op} "\\n"? %json {json.dumps(_call_schema(req, self.key))}\n'
    if req.choice == "auto":
      return (f'%llguidance {{}}\nstart: TEXT | first{rest}\nTEXT: /(.|\\n)*/\ntrig[lazy]: TEXT {op}\nfirst: trig {body}{more}\n')
    return f"%llguidance {{}}\nstart: first{rest}\nfirst: {op} {body}{more}\n"

  def parse(self, span: str) -> list[ToolCall]:
    """The call(s) between one opening and closing marker; ValueError when it is not a call."""
    v = json.loads(span)
    if not isinstance(v, dict) or not isinstance(v.get("name"), str): raise ValueError("not a call")
    args = v.get(self.key, v.get("arguments", v.get("parameters", {})))
    if not isinstance(args, dict): raise ValueError("arguments are not an object")
    return [new_call(v["name"], args)]


class Llama3Format(CallFormat):
  """Llama 3.1+: the whole answer is the call's JSON, `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`); its end token closes it."""
  name, open, close, key = "llama3", "", "", "parameters"

  def render(self, calls: Sequence[Mapping[str, Any]]) -> str:
    return "; ".join(json.dumps({"name": c["function"]["name"], self.key: c["function"]["arguments"]}, ensure_ascii=False) for c in calls)

  def grammar(self, req: ToolRequest, tok: Any) -> str:
    call = f"%json {json.dumps(_call_schema(req, self.key))}"
    if req.choice == "auto": return f"%llguidance {{}}\nstart: FREE | {call}\nFREE: /([^{{ \\n](.|\\n)*)?/\n"
    return f"%llguidance {{}}\nstart: {call}\n"

  def parse(self, span: str) -> list[ToolCall]:
    """One call, or several joined by ';' (as Llama 3.2 writes parallel calls)."""
    span = span.strip().removeprefix("<|python_tag|>").strip()
    try: return super().parse(span)
    except ValueError:
      if ";" not in span: raise
    calls = []
    for part in span.split(";"):
      if part.strip(): calls += super().parse(part)
    return calls


DSML = "｜DSML｜"
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]+)">(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{DSML}parameter>', re.S)


class DSMLFormat(CallFormat):
  """DeepSeek V3.2's published DSML: `<｜DSML｜function_calls>` with one `<｜DSML｜invoke name=...>` per call and
  `<｜DSML｜parameter name=... string="true|false">` per argument (string="true": the raw text, else JSON). Parsed only."""
  name, open, close, key = "dsml", f"<{DSML}function_calls>", f"</{DSML}function_calls>", "arguments"
  constrained = False

  def render(self, calls: Sequence[Mapping[str, Any]]) -> str:
    def param(k: str, v: Any) -> str:
      text, is_str = (v, "true") if isinstance(v, str) else (json.dumps(v, ensure_ascii=False), "false")
      return f'<{DSML}parameter name="{k}" string="{is_str}">{text}</{DSML}parameter>'
    inv = [f'<{DSML}invoke name="{c["function"]["name"]}">\n' + "\n".join(param(k, v) for k, v in c["function"]["arguments"].items())
           + f"\n</{DSML}invoke>" for c in calls]
    return f"{self.open}\n" + "\n".join(inv) + f"\n{self.close}"

  def grammar(self, req: ToolRequest, tok: Any) -> str:
    raise errors.InvalidOption("tool_choice", "this model writes tool calls in DeepSeek's DSML, which pyruntime parses but cannot "
                               "constrain: only tool_choice 'auto' or 'none'")

  def parse(self, span: str) -> list[ToolCall]:
    calls = []
    for name, body in _INVOKE.findall(span):
      args = {k: (v if s != "false" else json.loads(v)) for k, s, v in _PARAM.findall(body)}
      calls.append(new_call(name, args))
    if not calls: raise ValueError("no invoke in the block")
    return calls


FORMATS = {f.name: f for f in (CallFormat(), Llama3Format(), DSMLFormat())}


def format_of(template: str | None, has_token: Any) -> tuple[CallFormat, bool] | None:
  """The family a model writes calls in, and whether its template renders tools itself; None when neither the template
  nor the ChatML fallback can give it tools."""
  knows = bool(template) and _uses_tools(template)
  if knows:
    assert template is not None
    if DSML in template: return FORMATS["dsml"], True
    if "<tool_call>" in template: return FORMATS["hermes"], True
    if "<|python_tag|>" in template or "<|start_header_id|>" in template: return FORMATS["llama3"], True
    return None
  if "<|im_start|>" in (template or "") or (not template and has_token("<|im_start|>")):
    return FORMATS["hermes"], False  # a ChatML template (or ChatML by default): the Hermes convention (docs/tools.md)
  return None


@functools.lru_cache(maxsize=16)
def _uses_tools(template: str) -> bool:
  import jinja2
  from jinja2 import meta
  try: return "tools" in meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template))
  except jinja2.TemplateSyntaxError: return "tools" in template


# --- the fallback rendering: tools and calls as messages any ChatML template shows -----------------------------------
HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def fallback_messages(messages: list[dict[str, Any]], req: ToolRequest | None, fmt: CallFormat) -> list[dict[str, Any]]:
  """Messages for a template that knows only role and content: the tools in the system turn, each assistant call as
  its text, tool results as a user turn of <tool_response> blocks (consecutive results in one turn)."""
  out: list[dict[str, Any]] = []
  if req is not None and req.calls_allowed:
    system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in req.tools))
    if messages and messages[0]["role"] == "system": system = f"{messages[0]['content']}\n\n{system}"
    out.append({"role": "system", "content": system})
    messages = messages[1:] if messages and messages[0]["role"] == "system" else messages
  for m in messages:
    if m["role"] == "assistant" and m.get("tool_calls"):
      text = "\n".join(x for x in (m.get("content") or "", fmt.render(m["tool_calls"])) if x)
      out.append({"role": "assistant", "content": text})
    elif m["role"] == "tool":
      block = f"<tool_response>\n{m['content']}\n</tool_response>"
      if out and out[-1].get("tool_result"): out[-1]["content"] += "\n" + block
      else: out.append({"role": "user", "content": block, "tool_result": True})
    else: out.append({k: v for k, v in m.items() if k != "tool_calls"})
  return [{k: v for k, v in m.items() if k != "tool_result"} for m in out]


# --- reading calls back out of the stream -------------------------------------------------------------------------
class ToolCallParser:
  """Splits a stream's text into content and calls as it arrives: `feed(text)` and `finish()` return (content, calls).
  A span that does not parse as a call goes out as content (nothing is lost); so does one cut short (max_tokens)."""

  def __init__(self, fmt: CallFormat):
    self.fmt, self.buf, self.in_call, self.calls = fmt, "", False, 0
    self.whole = not fmt.open  # Llama 3: a call is the whole answer, decided by its first character
    self.plain = False         # ... and an answer that starts as text is text to its end

  def feed(self, text: str) -> tuple[str, list[ToolCall]]:
    if self.plain: return text, []
    self.buf += text
    if self.whole: return self._feed_whole()
    content, calls = [], []
    while True:
      if not self.in_call:
        i = self.buf.find(self.fmt.open)
        if i < 0:
          # the marker may be arriving in pieces; trailing blanks wait for what follows them (before a call they are
          # not content)
          head = self.buf[:len(self.buf) - _partial_suffix(self.buf, self.fmt.open)].rstrip()
          content.append(head); self.buf = self.buf[len(head):]
          break
        if self.calls == 0 or self.buf[:i].strip(): content.append(self.buf[:i])  # blanks between two calls are not content
        self.buf = self.buf[i:]
        self.in_call = True
      j = self.buf.find(self.fmt.close, len(self.fmt.open))
      if j < 0: break
      span, self.buf, self.in_call = self.buf[:j + len(self.fmt.close)], self.buf[j + len(self.fmt.close):], False
      got = self._parse(span[len(self.fmt.open):-len(self.fmt.close)])
      if got is None: content.append(span)
      else: calls += got
    return "".join(content), calls

  def _feed_whole(self) -> tuple[str, list[ToolCall]]:
    lead = self.buf.lstrip()
    if not lead or "<|python_tag|>".startswith(lead): return "", []  # undecided yet
    if lead.startswith(("{", "<|python_tag|>")): self.in_call = True
    if self.in_call: return "", []
    self.plain, self.buf, text = True, "", self.buf
    return text, []

  def finish(self) -> tuple[str, list[ToolCall]]:
    """What is still held at the end: an open call whose JSON is whole is a call (its closing marker was cut by the
    budget, or never due: a forced call ends with its JSON), anything else text."""
    text, self.buf = self.buf, ""
    if self.in_call and self.whole and (got := self._parse(text)) is not None: return "", got
    if self.in_call and not self.whole:
      span = text[len(self.fmt.open):].rstrip()
      if (got := self._parse(span[:len(span) - _partial_suffix(span, self.fmt.close)])) is not None: return "", got
    return "" if self.calls and not text.strip() else text, []

  def _parse(self, span: str) -> list[ToolCall] | None:
    try: calls = self.fmt.parse(span)
    except (ValueError, TypeError, RecursionError): return None  # not a call: it stays text
    self.calls += len(calls)
    return calls


def _partial_suffix(text: str, marker: str) -> int:
  """The length of the longest end of `text` that begins `marker`."""
  for n in range(min(len(text), len(marker) - 1), 0, -1):
    if marker.startswith(text[-n:]): return n
  return 0
