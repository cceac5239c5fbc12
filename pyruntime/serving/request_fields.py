"""Every field of every route's request body, declared once: its name, JSON type, bounds, and the routes that take it.

`check_body(body, route)` is the first thing every route does with a body: a field no entry names for the route is an
`UnsupportedFeature` naming it; a field we do not do (an entry with `neutral`) is accepted only at a value that asks
for nothing (a client that spells out a default is not asking for a feature); every other field must have its JSON
type and bounds, else `InvalidOption` naming it. `null` is the field absent, as OpenAI's servers read it. What a field's
value holds inside (messages, tools, a schema, a prompt's items) is its parser's to check, naming the path
(`messages[1].role`); the table is what keeps a new route or field from skipping the first checks. The routes' own
modules read the checked values: openai_api (chat, completions, /tokenize, /detokenize), responses_api (Responses).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from pyruntime import errors
from pyruntime.params import MAX_CHOICES, MAX_TOKENS, SAMPLING, Param
from pyruntime.params import show as _show
from pyruntime.protocol import MAX_TOP_LOGPROBS

CHAT, COMPLETION, RESPONSES, TOKENIZE, DETOKENIZE = "chat", "completion", "responses", "tokenize", "detokenize"
PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions", RESPONSES: "/v1/responses", TOKENIZE: "/tokenize",
         DETOKENIZE: "/detokenize"}

STRING, INTEGER, NUMBER, BOOLEAN, OBJECT, ARRAY = "string", "integer", "number", "boolean", "object", "array"
_WORDS = {STRING: "a string", INTEGER: "an integer", NUMBER: "a number", BOOLEAN: "true or false", OBJECT: "an object",
          ARRAY: "a list"}


def _is(v: Any, kind: str) -> bool:
  if kind == STRING: return isinstance(v, str)
  if kind == BOOLEAN: return isinstance(v, bool)
  if kind == OBJECT: return isinstance(v, dict)
  if kind == ARRAY: return isinstance(v, list)
  return not isinstance(v, bool) and isinstance(v, int if kind == INTEGER else (int, float))  # bounds: the field's Param


@dataclass(frozen=True)
class Field:
  name: str
  types: tuple[str, ...]           # the JSON types its value may have
  routes: frozenset[str]
  param: Param | None = None       # a number's bounds (and its words), as the CLI and the launcher check it
  neutral: tuple[Any, ...] | None = None  # a feature we refuse: the values that ask for nothing (accepted as absent)
  why: str = ""                    # why a refused value is refused, when more can be said than "not supported"
  hint: str = ""                   # the shape expected, said when the type is wrong

  def check(self, v: Any) -> None:
    """InvalidOption naming the field unless `v` (not null) has one of its types and lies within its bounds (a number's
    in the words the CLI and the launcher use: its Param's)."""
    if self.param is not None: self.param.check(v); return
    if not any(_is(v, t) for t in self.types):
      words = " or ".join(_WORDS[t] for t in self.types)
      raise errors.InvalidOption(self.name, f"must be {words}{' ' + self.hint if self.hint else ''}, got {_show(v)}")

  def asks_nothing(self, v: Any) -> bool:
    return any(type(v) is type(n) and v == n for n in self.neutral or ())


def _routes(*names: str) -> frozenset[str]: return frozenset(names)


def _int(name: str, lo: int, hi: int | None = None, *, nullable: bool = False) -> Param:
  return Param(name, int, None, "", lo=lo, hi=hi, nullable=nullable)


_GEN, _OPENAI, _ALL = _routes(CHAT, COMPLETION, RESPONSES), _routes(CHAT, COMPLETION), _routes(*PATHS)
_TOOLS = _routes(CHAT, RESPONSES)
_TAKEN_FIELDS = [
  Field("model", (STRING,), _ALL),
  Field("user", (STRING,), _GEN),
  Field("stream", (BOOLEAN,), _GEN),
  *[Field(p.name, (INTEGER,) if p.kind is int else (NUMBER,), _GEN, p) for p in SAMPLING.values()],
  # chat and completions
  Field("max_tokens", (INTEGER,), _routes(CHAT), MAX_TOKENS),
  Field("max_tokens", (INTEGER,), _routes(COMPLETION), replace(MAX_TOKENS, lo=0)),  # 0 with echo: scoring the prompt alone
  Field("n", (INTEGER,), _OPENAI, _int("n", 1, MAX_CHOICES)),
  Field("stop", (STRING, ARRAY), _OPENAI),
  Field("stream_options", (OBJECT,), _OPENAI, hint="like {'include_usage': true}"),
  # vLLM's extensions: generate through end tokens (fixed-length outputs for benchmarks), a prefix-cache salt
  Field("ignore_eos", (BOOLEAN,), _OPENAI),
  Field("cache_salt", (STRING,), _OPENAI),
  # ours: keep a request out of the prefix cache, out of speculative decoding
  Field("prefix_cache", (BOOLEAN,), _OPENAI),
  Field("speculative", (BOOLEAN,), _OPENAI),
  Field("response_format", (OBJECT,), _OPENAI, hint="like {'type': 'json_object'}"),
  Field("prediction", (OBJECT,), _OPENAI, hint="like {'type': 'content', 'content': the predicted text}"),
  # chat
  Field("messages", (ARRAY,), _routes(CHAT, TOKENIZE)),
  Field("max_completion_tokens", (INTEGER,), _routes(CHAT), _int("max_completion_tokens", 1, nullable=True)),
  Field("tools", (ARRAY,), _TOOLS),
  Field("tool_choice", (STRING, OBJECT), _TOOLS),
  Field("parallel_tool_calls", (BOOLEAN,), _TOOLS),
  Field("logprobs", (BOOLEAN,), _routes(CHAT)),
  Field("top_logprobs", (INTEGER,), _routes(CHAT, RESPONSES), _int("top_logprobs", 0, MAX_TOP_LOGPROBS)),
  # completions: logprobs is how many alternatives there
  Field("prompt", (STRING, ARRAY), _routes(COMPLETION)),
  Field("logprobs", (INTEGER,), _routes(COMPLETION), _int("logprobs", 0, MAX_TOP_LOGPROBS)),
  Field("echo", (BOOLEAN,), _routes(COMPLETION)),
  # Responses (its metadata and user come back in the response; prompt_cache_key and safety_identifier are hints)
  Field("input", (STRING, ARRAY), _routes(RESPONSES)),
  Field("instructions", (STRING,), _routes(RESPONSES)),
  Field("max_output_tokens", (INTEGER,), _routes(RESPONSES), _int("max_output_tokens", 1)),
  Field("text", (OBJECT,), _routes(RESPONSES), hint="like {'format': {'type': 'text'}}"),
  Field("include", (ARRAY,), _routes(RESPONSES)),
  Field("metadata", (OBJECT,), _routes(RESPONSES)),
  Field("prompt_cache_key", (STRING,), _routes(RESPONSES)),
  Field("safety_identifier", (STRING,), _routes(RESPONSES)),
  # the tokenizer routes
  Field("prompt", (STRING,), _routes(TOKENIZE)),
  Field("add_special_tokens", (BOOLEAN,), _routes(TOKENIZE)),
  Field("tokens", (ARRAY,), _routes(DETOKENIZE)),
]
_STORED = "nothing is stored: send the whole conversation as input"
_REFUSED_FIELDS = [
  Field("tools", (ARRAY,), _routes(COMPLETION), neutral=([],)),
  Field("tool_choice", (STRING, OBJECT), _routes(COMPLETION), neutral=("none",)),
  Field("parallel_tool_calls", (BOOLEAN,), _routes(COMPLETION), neutral=()),
  Field("functions", (ARRAY,), _OPENAI, neutral=([],)),
  Field("function_call", (STRING, OBJECT), _OPENAI, neutral=("none",)),
  Field("logit_bias", (OBJECT,), _OPENAI, neutral=({},)),
  Field("best_of", (INTEGER,), _OPENAI, neutral=(1,)),
  Field("suffix", (STRING,), _OPENAI, neutral=("",)),
  Field("store", (BOOLEAN,), _OPENAI, neutral=(False,)),
  Field("store", (BOOLEAN,), _routes(RESPONSES), neutral=(False,), why=_STORED),
  Field("metadata", (OBJECT,), _OPENAI, neutral=()),
  Field("modalities", (ARRAY,), _OPENAI, neutral=(["text"],)),
  Field("audio", (OBJECT,), _OPENAI, neutral=()),
  Field("reasoning_effort", (STRING,), _OPENAI, neutral=()),
  Field("service_tier", (STRING,), _GEN, neutral=("auto", "default")),
  Field("web_search_options", (OBJECT,), _OPENAI, neutral=()),
  Field("previous_response_id", (STRING,), _routes(RESPONSES), neutral=(), why=_STORED),
  Field("conversation", (STRING, OBJECT), _routes(RESPONSES), neutral=(), why=_STORED),
  Field("truncation", (STRING,), _routes(RESPONSES), neutral=("disabled",)),
  Field("background", (BOOLEAN,), _routes(RESPONSES), neutral=(False,)),
  Field("reasoning", (OBJECT,), _routes(RESPONSES), neutral=({},)),
  Field("max_tool_calls", (INTEGER,), _routes(RESPONSES), neutral=()),
  Field("stream_options", (OBJECT,), _routes(RESPONSES), neutral=({}, {"include_obfuscation": False})),
  Field("prompt", (OBJECT,), _routes(RESPONSES), neutral=()),
]
FIELDS: dict[str, dict[str, Field]] = {r: {} for r in PATHS}
for _f in _TAKEN_FIELDS + _REFUSED_FIELDS:
  for _r in _f.routes:
    assert _f.name not in FIELDS[_r], f"{_f.name} declared twice for {_r}"
    FIELDS[_r][_f.name] = _f


def check_body(body: dict[str, Any], route: str) -> None:
  """The route's first check of a body (a dict): every field declared for the route, every refused feature at its
  neutral value, then every field's JSON type and bounds; the first failure raised, naming the field."""
  table = FIELDS[route]
  for name, v in body.items():
    if v is None: continue
    f = table.get(name)
    if f is None: raise errors.UnsupportedFeature(name, f"unrecognized request argument for {PATHS[route]}")
    if f.neutral is not None and not _neutral(f, v):
      raise errors.UnsupportedFeature(name, f.why or f"pyruntime does not support {name}={dump(v)} on {PATHS[route]}")
  for name, v in body.items():
    if v is not None and table[name].neutral is None: table[name].check(v)


def _neutral(f: Field, v: Any) -> bool:
  # Responses' reasoning: an object of nulls ({"effort": null, "summary": null}) asks for nothing too
  return f.asks_nothing(v) or (f.name == "reasoning" and isinstance(v, dict) and not any(v.values()))


def dump(v: Any, limit: int = 80) -> str:
  """A client's value quoted back in an error: its JSON, cut to `limit` characters (repr where it has none)."""
  try: return json.dumps(v)[:limit]
  except (ValueError, RecursionError): return _show(v, limit)
