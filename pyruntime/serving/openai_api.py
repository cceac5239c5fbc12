"""OpenAI request parsing and response shaping: pure functions, no HTTP and no launcher.

`parse_request` turns a decoded JSON body into the keyword arguments of `Launcher.generate`,
raising `InvalidOption(field)` for a bad value and `UnsupportedFeature(field)` for anything we
do not do (never silently ignored, docs/serving.md). `error_body` maps every error to OpenAI's error
shape and an HTTP status. `ChatShaper` / `CompletionShaper` build OpenAI's response objects and
stream chunks from the launcher's `Delta` / `Done` events.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from pyruntime import errors
from pyruntime.params import INT64_MAX, MAX_TOKENS, SAMPLING, Param
from pyruntime.params import show as _show

CHAT, COMPLETION = "chat", "completion"

# The launcher's sampling options (pyruntime/params.py, docs/serving.md#sampling); the names are the request field names.
SAMPLING_FIELDS = tuple(SAMPLING)
# ignore_eos: vLLM's extension (generate through end tokens), which serving benchmarks use for fixed-length outputs
# cache_salt: vLLM's (requests with different salts share no cached prefix); prefix_cache: false keeps a request out of it
# response_format: text, json_object or json_schema, enforced by a grammar at the tail (pyruntime/text/grammar.py)
# speculative: false keeps a request out of speculative decoding (docs/speculation.md)
_COMMON = {"model", "max_tokens", "stop", "n", "stream", "stream_options", "user", "ignore_eos", "cache_salt", "prefix_cache",
           "response_format", "speculative", "prediction", *SAMPLING_FIELDS}
# tools, tool_choice, parallel_tool_calls: function tools (pyruntime/text/tools.py, docs/tools.md); chat only
SUPPORTED = {CHAT: _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls"},
             COMPLETION: _COMMON | {"prompt"}}

# OpenAI features we refuse by name. A value that asks for nothing (the field's neutral value) is
# accepted: a client that spells out a default is not asking for a feature.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
  "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
  "parallel_tool_calls": (), "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "best_of": (1,), "echo": (False,),
  "suffix": ("",), "store": (False,), "metadata": (), "modalities": (["text"],), "audio": (),
  "reasoning_effort": (), "service_tier": ("auto", "default"), "web_search_options": (),
}
UNSUPPORTED_VALUE_FIELDS = {"n", "stream_options"}


class MalformedRequest(errors.PyruntimeError):
  """The body is not a JSON object."""


class QueueFull(errors.PyruntimeError):
  def __init__(self, size: int):
    super().__init__(f"the server is busy: {size} requests are already waiting; retry later")
    self.size = size


class ServiceUnavailable(errors.PyruntimeError):
  """The server takes no new requests for now (503, with a Retry-After of `retry_after` seconds)."""
  def __init__(self, message: str, retry_after: int = 1):
    super().__init__(message)
    self.retry_after = retry_after


class ServerRecovering(ServiceUnavailable):
  """A stage died; the server is restarting the pipeline."""


class ServerDraining(ServiceUnavailable):
  """The server is shutting down: it finishes the running requests and takes no new ones."""


class ServerShuttingDown(errors.PyruntimeError):
  """A running request the server ended because it shut down before the request finished."""


class RequestTooLarge(errors.PyruntimeError):
  """The request body is longer than the server's limit (refused once the limit is passed, unread beyond it)."""
  def __init__(self, limit: int, length: int | None = None):
    got = f"{length} bytes" if length is not None else "more than that"
    super().__init__(f"the request body is too large: the limit is {limit} bytes, got {got}")
    self.limit, self.length = limit, length


class RequestTimeout(errors.PyruntimeError):
  """The request body did not arrive in time."""
  def __init__(self, seconds: float):
    super().__init__(f"the request body did not arrive within {seconds:g} s")
    self.seconds = seconds


class ModelNotFound(errors.PyruntimeError):
  def __init__(self, model: str, served: str):
    super().__init__(f"The model {_show(model)} does not exist; this server serves {served!r}")
    self.model, self.served = model, served


def model_id(source: str | os.PathLike[str]) -> str:
  """A model id a client can type: the GGUF file's stem (or a display name), lowercased, with each
  run of anything but letters, digits, '.', '_' and '-' replaced by one '-'.

      model_id("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"
      model_id("Smollm2 135M 8k") == "smollm2-135m-8k"
  """
  name = pathlib.PurePath(os.fspath(source)).name
  if name.lower().endswith(".gguf"): name = name[:-len(".gguf")]
  return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "model"


@dataclass
class ParsedRequest:
  kind: str                              # CHAT | COMPLETION
  stream: bool = False
  include_usage: bool = False
  model: str | None = None               # what the client asked for (any name is accepted)
  generate: dict[str, Any] = field(default_factory=dict)   # keyword arguments of Launcher.generate


# --- parsing ------------------------------------------------------------------------------------
def _no_constant(name: str) -> Any:
  raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
  """The request body as a dict; MalformedRequest (a 400) for anything that is not a JSON object: bad
  syntax or encoding, nesting too deep for the parser, an integer beyond Python's digit limit, NaN/Infinity."""
  try: body = json.loads(raw, parse_constant=_no_constant)
  except RecursionError:
    raise MalformedRequest("We could not parse the JSON body of your request: it is nested too deeply. "
                           "The body must be a JSON object.") from None
  except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, int digit limit, NaN/Infinity
    raise MalformedRequest(f"We could not parse the JSON body of your request ({_show(str(e), 200)}). "
                           "The body must be a JSON object.") from None
  if not isinstance(body, dict): raise MalformedRequest(f"the request body must be a JSON object, not {type(body).__name__}")
  return body



def _dump(v: Any, limit: int = 80) -> str:
  try: return json.dumps(v)[:limit]
  except (ValueError, RecursionError): return _show(v, limit)


def _is_int(v: Any) -> bool: return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int = -INT64_MAX - 1, hi: int = INT64_MAX) -> int | None:
  """An integer field within [lo, hi] (int64 unless the field says otherwise: no 300-digit values downstream)."""
  v = body.get(name)
  if v is None: return None
  if not _is_int(v): raise errors.InvalidOption(name, f"must be an integer, got {_show(v)}")
  if v < lo: raise errors.InvalidOption(name, f"must be at least {lo}, got {_show(v)}")
  if v > hi: raise errors.InvalidOption(name, f"must be at most {hi}, got {_show(v)}")
  return v


def _param(body: dict, p: Param) -> Any:
  """A field defined in pyruntime/params.py; null is absent (None)."""
  return None if body.get(p.name) is None else p.check(body[p.name])


def _bool(body: dict, name: str) -> bool | None:
  v = body.get(name)
  if v is None: return None
  if not isinstance(v, bool): raise errors.InvalidOption(name, f"must be true or false, got {_show(v)}")
  return v


def _check_unsupported(body: dict, kind: str) -> None:
  for name, value in body.items():
    if name in SUPPORTED[kind] or value is None: continue
    if name in _NEUTRAL and any(type(value) is type(n) and value == n for n in _NEUTRAL[name]): continue
    if name in _NEUTRAL: raise errors.UnsupportedFeature(name, f"pyruntime does not support {name}={_dump(value)}")
    raise errors.UnsupportedFeature(name, f"unrecognized request argument for /v1/{'chat/completions' if kind == CHAT else 'completions'}")


def parse_request(body: dict[str, Any], kind: str) -> ParsedRequest:
  """Validate an OpenAI request body; raise InvalidOption / UnsupportedFeature naming the field."""
  # long (~55 lines): one check per OpenAI field, in the reference's order
  _check_unsupported(body, kind)
  req = ParsedRequest(kind)
  model = body.get("model")
  if model is not None and not isinstance(model, str): raise errors.InvalidOption("model", f"must be a string, got {_show(model)}")
  req.model = model
  if (user := body.get("user")) is not None and not isinstance(user, str): raise errors.InvalidOption("user", "must be a string")
  n = _int(body, "n", lo=1)
  if n is not None and n != 1: raise errors.UnsupportedFeature("n", f"only n=1 is supported, got n={n}")
  req.stream = bool(_bool(body, "stream"))
  opts = body.get("stream_options")
  if opts is not None:
    if not isinstance(opts, dict): raise errors.InvalidOption("stream_options", "must be an object like {'include_usage': true}")
    if not req.stream: raise errors.InvalidOption("stream_options", "is only allowed when stream is true")
    for key in opts:
      if key != "include_usage": raise errors.UnsupportedFeature(f"stream_options.{key}", "only include_usage is supported")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool): raise errors.InvalidOption("stream_options.include_usage", "must be true or false")
    req.include_usage = bool(usage)

  gen: dict[str, Any] = {}
  max_tokens = _param(body, MAX_TOKENS)
  if kind == CHAT:
    mct = _param(body, replace(MAX_TOKENS, name="max_completion_tokens"))
    if mct is not None and max_tokens is not None and mct != max_tokens:
      raise errors.InvalidOption("max_completion_tokens", f"is {mct} but max_tokens is {max_tokens}: give one of them")
    if mct is not None: max_tokens = mct
    gen["max_tokens"] = max_tokens          # None: up to the context (OpenAI's default for chat)
    if "messages" not in body or body["messages"] is None: raise errors.InvalidOption("messages", "is required")
    from pyruntime.text.chat import validate_messages
    validate_messages(body["messages"])     # fail fast, naming e.g. messages[1].role; the launcher renders them
    gen["messages"] = body["messages"]
    from pyruntime.text.tools import check_tools
    if check_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")) is not None:
      gen.update({k: body[k] for k in ("tools", "tool_choice", "parallel_tool_calls") if body.get(k) is not None})
  else:
    gen["max_tokens"] = 16 if max_tokens is None else max_tokens   # OpenAI's default for /v1/completions
    gen["prompt"], gen["raw"] = _prompt(body.get("prompt")), True

  if _bool(body, "ignore_eos"): gen["ignore_eos"] = True
  if (salt := body.get("cache_salt")) is not None:
    if not isinstance(salt, str) or not salt: raise errors.InvalidOption("cache_salt", f"must be a non-empty string, got {_show(salt)}")
    from pyruntime.engine.request import check_salt
    check_salt(salt)
    gen["cache_salt"] = salt
  if _bool(body, "prefix_cache") is False: gen["prefix_cache"] = False
  if _bool(body, "speculative") is False: gen["speculative"] = False
  if (prediction := body.get("prediction")) is not None: gen["prediction"] = _prediction(prediction)
  if (rf := body.get("response_format")) is not None:
    from pyruntime.text.grammar import grammar_for
    # its shape and schema checked here, named; the launcher checks the grammar against the vocabulary
    if grammar_for(rf) is not None: gen["response_format"] = rf
  from pyruntime.params import validate_stop
  stop = validate_stop(body.get("stop"))
  if stop: gen["stop"] = stop
  sampling = {name: _param(body, p) for name, p in SAMPLING.items()}
  gen.update({k: v for k, v in sampling.items() if v is not None})
  req.generate = gen
  return req


def _prediction(p: Any) -> str:
  """OpenAI's predicted output, `{"type": "content", "content": text or [text parts]}`: its text (a drafter for
  speculative decoding, docs/speculation.md; it never changes the answer)."""
  if not isinstance(p, dict) or p.get("type") != "content":
    raise errors.InvalidOption("prediction", "must be {'type': 'content', 'content': the predicted text}")
  from pyruntime.text.chat import _content
  return _content(p.get("content"), "prediction.content")


def _prompt(prompt: Any) -> str:
  if prompt is None: raise errors.InvalidOption("prompt", "is required")
  if isinstance(prompt, list):
    if prompt and (all(_is_int(t) for t in prompt) or all(isinstance(t, list) for t in prompt)):
      raise errors.UnsupportedFeature("prompt", "token-id prompts are not supported; send the prompt as a string")
    if len(prompt) != 1: raise errors.UnsupportedFeature("prompt", f"batched prompts are not supported (got {len(prompt)}); send one string")
    prompt = prompt[0]
  if not isinstance(prompt, str): raise errors.InvalidOption("prompt", f"must be a string, got {type(prompt).__name__}")
  if not prompt: raise errors.EmptyPrompt("the prompt is empty")
  return prompt


# --- errors ---------------------------------------------------------------------------------------
def error_body(exc: BaseException, kind: str | None = None) -> tuple[int, dict[str, Any]]:
  """(HTTP status, OpenAI error object) for any exception raised while serving a request."""
  def shape(status: int, message: str, type_: str, param: str | None, code: str | None) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}
  bad = "invalid_request_error"
  if isinstance(exc, errors.ContextLengthExceeded):
    has = f"at least {exc.prompt_tokens}" if exc.at_least else f"{exc.prompt_tokens}"
    message = (f"This model's maximum context length is {exc.context} tokens. However, your prompt has {has} tokens; "
               f"shorten it to at most {exc.context - 1} tokens.")
    return shape(400, message, bad, "messages" if kind == CHAT else "prompt", "context_length_exceeded")
  if isinstance(exc, errors.InvalidOption):
    param = exc.field
    if kind == CHAT and param == "prompt": param = "messages"   # the launcher's name for what the client sent as messages
    return shape(400, str(exc), bad, param, "invalid_value")
  if isinstance(exc, errors.UnsupportedFeature):
    code = "unsupported_value" if exc.feature in UNSUPPORTED_VALUE_FIELDS or exc.feature == "prompt" else "unsupported_parameter"
    return shape(400, str(exc), bad, exc.feature, code)
  if isinstance(exc, MalformedRequest): return shape(400, str(exc), bad, None, "invalid_json")
  if isinstance(exc, RequestTooLarge): return shape(413, str(exc), bad, None, "request_too_large")
  if isinstance(exc, RequestTimeout): return shape(408, str(exc), bad, None, "request_timeout")
  if isinstance(exc, ModelNotFound): return shape(404, str(exc), bad, "model", "model_not_found")
  if isinstance(exc, QueueFull): return shape(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded")
  if isinstance(exc, ServiceUnavailable): return shape(503, str(exc), "server_error", None, "service_unavailable")
  if isinstance(exc, ServerShuttingDown): return shape(503, str(exc), "server_error", None, "server_shutting_down")
  if isinstance(exc, errors.StageStalled): return shape(500, str(exc), "server_error", None, "stage_stalled")
  if isinstance(exc, errors.StageFailed): return shape(500, str(exc), "server_error", None, "stage_failed")
  if isinstance(exc, errors.LauncherClosed):
    return shape(503, f"the model is not running: {exc}", "server_error", None, "service_unavailable")
  if isinstance(exc, errors.PyruntimeError): return shape(500, f"{exc.code}: {exc}", "server_error", None, exc.code)
  return shape(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


# --- responses --------------------------------------------------------------------------------------
def usage_dict(done: Any) -> dict[str, Any]:
  u = done.usage
  return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
          "total_tokens": u.prompt_tokens + u.completion_tokens,
          "prompt_tokens_details": {"cached_tokens": getattr(u, "cached_tokens", 0)},
          "completion_tokens_details": {"accepted_prediction_tokens": getattr(u, "accepted_prediction_tokens", 0),
                                        "rejected_prediction_tokens": getattr(u, "rejected_prediction_tokens", 0)}}


def models_list(model_name: str, created: int, context_length: int | None = None) -> dict[str, Any]:
  return {"object": "list", "data": [model_card(model_name, created, context_length)]}


def model_card(model_name: str, created: int, context_length: int | None = None) -> dict[str, Any]:
  card = {"id": model_name, "object": "model", "created": created, "owned_by": "pyruntime"}
  if context_length is not None: card["context_length"] = context_length
  return card


class _Shaper:
  """Builds one request's response (non-streamed) or chunks (streamed)."""
  prefix = ""
  object_full = object_chunk = ""

  def __init__(self, model: str, fingerprint: str, include_usage: bool = False, created: int | None = None):
    self.id = f"{self.prefix}-{uuid.uuid4().hex}"
    self.created = int(time.time()) if created is None else created
    self.model, self.fingerprint, self.include_usage = model, fingerprint, include_usage

  def _envelope(self, obj: str) -> dict[str, Any]:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}

  def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
    c = self._envelope(self.object_chunk)
    c["choices"] = [choice]
    if self.include_usage: c["usage"] = None   # OpenAI: null on every chunk but the last
    return c

  def usage_chunk(self, done: Any) -> dict[str, Any]:
    c = self._envelope(self.object_chunk)
    c["choices"], c["usage"] = [], usage_dict(done)
    return c

  def first_chunks(self) -> list[dict[str, Any]]: return []
  def delta_chunk(self, text: str) -> dict[str, Any]: raise NotImplementedError
  def final_chunk(self, done: Any) -> dict[str, Any]: raise NotImplementedError
  def response(self, done: Any) -> dict[str, Any]: raise NotImplementedError

  def end_chunks(self, done: Any) -> list[dict[str, Any]]:
    out = [self.final_chunk(done)]
    if self.include_usage: out.append(self.usage_chunk(done))
    return out


class ChatShaper(_Shaper):
  prefix, object_full, object_chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"
  n_calls = 0  # tool calls streamed so far: the next one's index

  def first_chunks(self) -> list[dict[str, Any]]:
    return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})]

  def delta_chunk(self, text: str) -> dict[str, Any]:
    return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None})

  def tool_calls_chunk(self, calls: list[Any]) -> dict[str, Any]:
    """Calls go out whole, each in one delta (id, name and all its arguments): a call is parsed when its closing
    marker arrives, and OpenAI's clients join a call's deltas by `index` either way."""
    first, self.n_calls = self.n_calls, self.n_calls + len(calls)
    return self._chunk({"index": 0, "delta": {"tool_calls": [{"index": first + i, **c.to_openai()} for i, c in enumerate(calls)]},
                        "logprobs": None, "finish_reason": None})

  def final_chunk(self, done: Any) -> dict[str, Any]:
    return self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": done.finish_reason})

  def response(self, done: Any) -> dict[str, Any]:
    r = self._envelope(self.object_full)
    message: dict[str, Any] = {"role": "assistant", "content": done.text}
    if done.tool_calls:  # OpenAI: content null when the answer is only calls
      message = {"role": "assistant", "content": done.text if done.text.strip() else None,
                 "tool_calls": [c.to_openai() for c in done.tool_calls]}
    r["choices"] = [{"index": 0, "message": message, "logprobs": None, "finish_reason": done.finish_reason}]
    r["usage"] = usage_dict(done)
    return r


class CompletionShaper(_Shaper):
  prefix, object_full, object_chunk = "cmpl", "text_completion", "text_completion"

  def delta_chunk(self, text: str) -> dict[str, Any]:
    return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

  def final_chunk(self, done: Any) -> dict[str, Any]:
    return self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": done.finish_reason})

  def response(self, done: Any) -> dict[str, Any]:
    r = self._envelope(self.object_full)
    r["choices"] = [{"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}]
    r["usage"] = usage_dict(done)
    return r


def shaper_for(kind: str, model: str, fingerprint: str, include_usage: bool = False) -> _Shaper:
  return (ChatShaper if kind == CHAT else CompletionShaper)(model, fingerprint, include_usage)


def sse(obj: Any) -> bytes:
  """One server-sent event: `data: <json>\\n\\n` (or `data: [DONE]\\n\\n`)."""
  data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
  return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
