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
from dataclasses import dataclass, field
from typing import Any

from pyruntime import errors
from pyruntime.params import MAX_CHOICES, SAMPLING
from pyruntime.params import show as _show
from pyruntime.serving.request_fields import CHAT, COMPLETION, DETOKENIZE, TOKENIZE, check_body

# every field of every route, its JSON type and bounds: pyruntime/serving/request_fields.py (docs/serving.md)
UNSUPPORTED_VALUE_FIELDS = {"stream_options"}  # fields taken whose refusals are of a value (OpenAI's unsupported_value)


class MalformedRequest(errors.PyruntimeError):
  """The body is not a JSON object."""


class QueueFull(errors.PyruntimeError):
  def __init__(self, size: int):
    super().__init__(f"the server is busy: every stream it runs is taken and {size} more wait; retry later")
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
  n: int = 1                             # choices per prompt
  prompts: list[str | list[int]] = field(default_factory=list)  # completions: each prompt of the batch (text or ids)
  echo: bool = False                     # completions: the prompt comes back before the answer
  logprobs: bool = False                 # the answer carries log-probabilities (generate's logprobs: how many alternatives)
  origins: list | None = None            # Responses: which input item each chat message came from (its errors' names)

  @property
  def choices(self) -> int: return self.n * max(1, len(self.prompts))


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



def _is_int(v: Any) -> bool: return isinstance(v, int) and not isinstance(v, bool)


def model_of(body: dict) -> str | None:
  """The `model` a request names (None: any), checked the same way on every route."""
  if (model := body.get("model")) is not None and not isinstance(model, str):
    raise errors.InvalidOption("model", f"must be a string, got {_show(model)}")
  return model


def parse_request(body: dict[str, Any], kind: str) -> ParsedRequest:
  """Validate an OpenAI request body; raise InvalidOption / UnsupportedFeature naming the field. Every field's type
  and bounds are the table's (request_fields.check_body); what is checked here is what one field says of another,
  and what a value holds inside."""
  check_body(body, kind)
  def get(name: str, default: Any = None) -> Any: return default if body.get(name) is None else body[name]
  req = ParsedRequest(kind, model=get("model"), n=get("n", 1), stream=get("stream", False))
  if (opts := get("stream_options")) is not None:
    if not req.stream: raise errors.InvalidOption("stream_options", "is only allowed when stream is true")
    for key in opts:
      if key != "include_usage": raise errors.UnsupportedFeature(f"stream_options.{key}", "only include_usage is supported")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool): raise errors.InvalidOption("stream_options.include_usage", "must be true or false")
    req.include_usage = bool(usage)

  gen: dict[str, Any] = {}
  if kind == CHAT:
    max_tokens, mct = get("max_tokens"), get("max_completion_tokens")
    if mct is not None and max_tokens is not None and mct != max_tokens:
      raise errors.InvalidOption("max_completion_tokens", f"is {mct} but max_tokens is {max_tokens}: give one of them")
    gen["max_tokens"] = max_tokens if mct is None else mct   # None: up to the context (OpenAI's default for chat)
    if get("messages") is None: raise errors.InvalidOption("messages", "is required")
    from pyruntime.text.chat import validate_messages
    validate_messages(body["messages"])     # fail fast, naming e.g. messages[1].role; the launcher renders them
    gen["messages"] = body["messages"]
    from pyruntime.text.tools import check_tools
    if check_tools(get("tools"), get("tool_choice"), get("parallel_tool_calls")) is not None:
      gen.update({k: body[k] for k in ("tools", "tool_choice", "parallel_tool_calls") if body.get(k) is not None})
    top = get("top_logprobs", 0)
    if get("logprobs"): req.logprobs, gen["logprobs"] = True, top
    elif top: raise errors.InvalidOption("top_logprobs", "needs logprobs: true")
  else:
    req.echo = get("echo", False)
    max_tokens = get("max_tokens", 16)  # OpenAI's default for /v1/completions
    # 0 generates nothing, which only scoring the prompt (echo) makes sense of
    if max_tokens == 0 and not req.echo: raise errors.InvalidOption("max_tokens", "must be at least 1 (0 only with echo: the prompt scored alone)")
    gen["max_tokens"] = max_tokens
    req.prompts, gen["raw"] = _prompts(get("prompt")), True
    if (k := get("logprobs")) is not None: req.logprobs, gen["logprobs"] = True, k
    # echo with logprobs scores the prompt
    if req.echo and (req.logprobs or max_tokens == 0): gen["prompt_logprobs"], gen["logprobs"] = True, gen.get("logprobs", 0)
  if req.choices > MAX_CHOICES:
    raise errors.InvalidOption("n", f"n times the prompts is {req.choices}: at most {MAX_CHOICES} choices per request")

  if get("ignore_eos"): gen["ignore_eos"] = True
  if (salt := get("cache_salt")) is not None:
    if not salt: raise errors.InvalidOption("cache_salt", "must be a non-empty string, got ''")
    from pyruntime.engine.request import check_salt
    check_salt(salt)
    gen["cache_salt"] = salt
  if get("prefix_cache") is False: gen["prefix_cache"] = False
  if get("speculative") is False: gen["speculative"] = False
  if (prediction := get("prediction")) is not None: gen["prediction"] = _prediction(prediction)
  if (rf := get("response_format")) is not None:
    from pyruntime.text.grammar import grammar_for
    # its shape and schema checked here, named; the launcher checks the grammar against the vocabulary
    if grammar_for(rf) is not None: gen["response_format"] = rf
  from pyruntime.params import validate_stop
  if stop := validate_stop(get("stop")): gen["stop"] = stop
  gen.update({k: body[k] for k in SAMPLING if body.get(k) is not None})
  req.generate = gen
  return req


def _prediction(p: Any) -> str:
  """OpenAI's predicted output, `{"type": "content", "content": text or [text parts]}`: its text (a drafter for
  speculative decoding, docs/speculation.md; it never changes the answer)."""
  if not isinstance(p, dict) or p.get("type") != "content":
    raise errors.InvalidOption("prediction", "must be {'type': 'content', 'content': the predicted text}")
  from pyruntime.text.chat import _content
  return _content(p.get("content"), "prediction.content")


def _prompts(prompt: Any) -> list[str | list[int]]:
  """The prompts of a completions request: a string, a list of token ids, or a batch of either (OpenAI's forms)."""
  if prompt is None: raise errors.InvalidOption("prompt", "is required")
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)): prompt = [prompt]
  if not isinstance(prompt, list) or not prompt:
    raise errors.InvalidOption("prompt", "must be a string, a list of token ids, or a non-empty list of either")
  for i, p in enumerate(prompt):
    where = f"prompt[{i}]" if len(prompt) > 1 else "prompt"
    if isinstance(p, str):
      if not p: raise errors.EmptyPrompt(f"{where} is empty")
    elif not (isinstance(p, list) and p and all(_is_int(t) for t in p)):
      raise errors.InvalidOption("prompt", f"{where} must be a string or a non-empty list of token ids")
  return prompt


# --- the tokenizer, served (vLLM's /tokenize, /detokenize; lm-eval's remote tokenizer reads /tokenizer_info) ----------
def tokenize(body: dict[str, Any], launcher: Any) -> dict[str, Any]:
  """`{"prompt": text, "add_special_tokens": true}` or `{"messages": [...]}` (rendered with the chat template) ->
  `{"tokens", "count", "max_model_len"}`. Special tokens written in the text are parsed, as in a completions prompt."""
  check_body(body, TOKENIZE)
  add = body.get("add_special_tokens")
  if (messages := body.get("messages")) is not None:
    if "prompt" in body: raise errors.InvalidOption("prompt", "give prompt or messages, not both")
    from pyruntime.text.chat import validate_messages
    validate_messages(messages)
    ids = launcher.prompt_ids(messages=messages)
  else:
    prompt = body.get("prompt")
    if not isinstance(prompt, str): raise errors.InvalidOption("prompt", f"must be a string, got {_show(prompt)}")
    ids = launcher.tokenizer.encode(prompt, parse_special=True, add_special=True if add is None else add)
  return {"tokens": ids, "count": len(ids), "max_model_len": launcher.context_length}


def detokenize(body: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
  """`{"tokens": [ids]}` -> `{"prompt": text}` (special tokens spelled out, as /tokenize reads them back)."""
  check_body(body, DETOKENIZE)
  ids = body.get("tokens")
  if not isinstance(ids, list) or not all(_is_int(t) for t in ids): raise errors.InvalidOption("tokens", "must be a list of token ids")
  try: return {"prompt": tokenizer.decode(ids, special=True)}
  except errors.TokenIdInvalid as e: raise errors.InvalidOption("tokens", str(e)) from None


def tokenizer_info(tokenizer: Any, context_length: int) -> dict[str, Any]:
  """The special tokens' text and the chat template: what a client needs to tokenize and stop as the server does."""
  def text(i: int | None) -> str | None: return None if i is None else tokenizer.token_text(i)
  return {"tokenizer_class": "gguf-bpe", "bos_token": text(tokenizer.bos_id), "eos_token": text(tokenizer.eot_id or tokenizer.eos_id),
          "pad_token": None, "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
          "model_max_length": context_length, "vocab_size": tokenizer.vocab_size}


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
    return shape(400, message, bad, {CHAT: "messages", "responses": "input"}.get(kind or "", "prompt"), "context_length_exceeded")
  if isinstance(exc, errors.InvalidOption):
    param = exc.field
    # the launcher's name for what the client sent as messages (or a Responses request's input)
    if param == "prompt" and kind in (CHAT, "responses"): param = "messages" if kind == CHAT else "input"
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
def models_list(model_name: str, created: int, context_length: int | None = None) -> dict[str, Any]:
  return {"object": "list", "data": [model_card(model_name, created, context_length)]}


def model_card(model_name: str, created: int, context_length: int | None = None) -> dict[str, Any]:
  card = {"id": model_name, "object": "model", "created": created, "owned_by": "pyruntime"}
  if context_length is not None: card["context_length"] = context_length
  return card


SSE_DONE = b"data: [DONE]\n\n"


def usage_of(dones: list[Any], choices_per_prompt: int) -> dict[str, Any]:
  """The usage of a request's choices: each prompt counted once (its n choices share it), every choice's tokens."""
  prompts = dones[::choices_per_prompt]
  u = {"prompt_tokens": sum(d.usage.prompt_tokens for d in prompts), "completion_tokens": sum(d.usage.completion_tokens for d in dones)}
  u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
  u["prompt_tokens_details"] = {"cached_tokens": sum(getattr(d.usage, "cached_tokens", 0) for d in prompts)}
  u["completion_tokens_details"] = {k: sum(getattr(d.usage, k, 0) for d in dones)
                                    for k in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
  return u


class TokenText:
  """A token's spelling in a log-probability entry: its text (control tokens spelled out; a piece of a UTF-8 character
  shows as U+FFFD, its bytes say what it is) and its bytes."""
  def __init__(self, tokenizer: Any):
    self.tokenizer = tokenizer

  def bytes(self, token: int) -> bytes: return self.tokenizer.token_bytes(token, special=True)
  def text(self, token: int) -> str: return self.bytes(token).decode("utf-8", "replace")

  def chat_entry(self, s: Any) -> dict[str, Any]:
    """One entry of a chat choice's `logprobs.content`."""
    return {"token": self.text(s.token), "logprob": s.logprob, "bytes": list(self.bytes(s.token)),
            "top_logprobs": [{"token": self.text(t), "logprob": lp, "bytes": list(self.bytes(t))} for t, lp in s.top]}

  def legacy(self, scores: list[Any | None], tokens: list[int], offset: int) -> dict[str, Any]:
    """A completions choice's `logprobs` (OpenAI's legacy shape): per token its text, log-probability, the top ones as
    a dict (None where there is no score: a prompt's first token) and its offset in the text from `offset` on."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, s in zip(tokens, scores, strict=True):
      text = self.text(t)
      out["tokens"].append(text)
      out["token_logprobs"].append(None if s is None else s.logprob)
      top: dict[str, float] | None = None if s is None else {}
      for a, lp in (s.top if s is not None else []): top.setdefault(self.text(a), lp)  # two tokens spelled alike: the likelier
      out["top_logprobs"].append(top)
      out["text_offset"].append(offset)
      offset += len(text)
    return out


class _Shaper:
  """Builds one request's response (non-streamed) or chunks (streamed), for each of its choices (by index)."""
  prefix = kind = ""
  object_full = object_chunk = ""

  def __init__(self, model: str, fingerprint: str, include_usage: bool = False, created: int | None = None, *, tokenizer: Any = None,
               n: int = 1, logprobs: bool = False):
    self.id = f"{self.prefix}-{uuid.uuid4().hex}"
    self.created = int(time.time()) if created is None else created
    self.model, self.fingerprint, self.include_usage = model, fingerprint, include_usage
    self.n, self.logprobs = n, logprobs
    self.spell = TokenText(tokenizer) if tokenizer is not None else None

  def _envelope(self, obj: str) -> dict[str, Any]:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}

  def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
    c = self._envelope(self.object_chunk)
    c["choices"] = [choice]
    if self.include_usage: c["usage"] = None   # OpenAI: null on every chunk but the last
    return c

  def usage_chunk(self, dones: list[Any]) -> dict[str, Any]:
    c = self._envelope(self.object_chunk)
    c["choices"], c["usage"] = [], usage_of(dones, self.n)
    return c

  done_marker = SSE_DONE  # after the last chunk (OpenAI's chat and completions streams)

  def first_chunks(self, choices: int) -> list[dict[str, Any]]: return []
  def delta_chunks(self, index: int, delta: Any) -> list[dict[str, Any]]: raise NotImplementedError
  def final_chunks(self, index: int, done: Any) -> list[dict[str, Any]]: raise NotImplementedError
  def choice(self, index: int, done: Any) -> dict[str, Any]: raise NotImplementedError
  def error_chunks(self, e: BaseException) -> list[dict[str, Any]]: return [error_body(e, self.kind)[1]]

  def response(self, dones: list[Any]) -> dict[str, Any]:
    r = self._envelope(self.object_full)
    r["choices"] = [self.choice(i, d) for i, d in enumerate(dones)]
    r["usage"] = usage_of(dones, self.n)
    return r


class ChatShaper(_Shaper):
  prefix, object_full, object_chunk, kind = "chatcmpl", "chat.completion", "chat.completion.chunk", CHAT

  def __init__(self, *args: Any, **kw: Any):
    super().__init__(*args, **kw)
    self.n_calls: dict[int, int] = {}  # per choice: tool calls streamed so far, the next one's index

  def first_chunks(self, choices: int) -> list[dict[str, Any]]:
    return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            for i in range(choices)]

  def _logprobs(self, scores: list[Any] | None) -> dict[str, Any] | None:
    return {"content": [self.spell.chat_entry(s) for s in scores or []], "refusal": None} if self.logprobs else None

  def delta_chunks(self, index: int, delta: Any) -> list[dict[str, Any]]:
    out = []
    if delta.text or (self.logprobs and delta.logprobs):
      out.append(self._chunk({"index": index, "delta": {"content": delta.text}, "logprobs": self._logprobs(delta.logprobs), "finish_reason": None}))
    if delta.tool_calls:
      # calls go out whole, each in one delta (id, name and all its arguments): a call is parsed when its closing marker
      # arrives, and OpenAI's clients join a call's deltas by `index` either way
      first = self.n_calls.get(index, 0)
      self.n_calls[index] = first + len(delta.tool_calls)
      calls = [{"index": first + i, **c.to_openai()} for i, c in enumerate(delta.tool_calls)]
      out.append(self._chunk({"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}))
    return out

  def final_chunks(self, index: int, done: Any) -> list[dict[str, Any]]:
    return [self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": done.finish_reason})]

  def choice(self, index: int, done: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.text}
    if done.tool_calls:  # OpenAI: content null when the answer is only calls
      message = {"role": "assistant", "content": done.text if done.text.strip() else None,
                 "tool_calls": [c.to_openai() for c in done.tool_calls]}
    return {"index": index, "message": message, "logprobs": self._logprobs(done.logprobs), "finish_reason": done.finish_reason}


class CompletionShaper(_Shaper):
  """Completions, with `echo` (the prompt's text, and with logprobs its scores, before the answer)."""
  prefix, object_full, object_chunk, kind = "cmpl", "text_completion", "text_completion", COMPLETION

  def __init__(self, *args: Any, echo: bool = False, prompts: list[str | list[int]] | None = None, **kw: Any):
    super().__init__(*args, **kw)
    self.echo, self.prompts = echo, prompts or []
    self.offset: dict[int, int] = {}  # per choice: characters streamed so far (text_offset)

  def _prompt_text(self, index: int, prompt_ids: list[int]) -> str:
    p = self.prompts[index // self.n] if self.prompts else None
    return p if isinstance(p, str) else self.spell.tokenizer.decode(prompt_ids, special=True)

  def _echo(self, index: int, prompt_ids: list[int], scores: list[Any] | None) -> tuple[str, dict[str, Any] | None]:
    text = self._prompt_text(index, prompt_ids)
    lp = self.spell.legacy([None, *scores], prompt_ids, 0) if self.logprobs and scores is not None else None
    return text, lp

  def delta_chunks(self, index: int, delta: Any) -> list[dict[str, Any]]:
    out = []
    if self.echo and index not in self.offset and delta.prompt_token_ids is not None:
      text, lp = self._echo(index, delta.prompt_token_ids, delta.prompt_logprobs)
      out.append(self._chunk({"index": index, "text": text, "logprobs": lp, "finish_reason": None}))
      self.offset[index] = len(text)
    if delta.text or (self.logprobs and delta.logprobs):
      off = self.offset.get(index, 0)
      lp = self.spell.legacy(delta.logprobs, delta.token_ids, off) if self.logprobs else None
      out.append(self._chunk({"index": index, "text": delta.text, "logprobs": lp, "finish_reason": None}))
      self.offset[index] = off + (sum(len(t) for t in lp["tokens"]) if lp else len(delta.text))
    return out

  def final_chunks(self, index: int, done: Any) -> list[dict[str, Any]]:
    text, lp = "", None
    if self.echo and index not in self.offset:  # nothing was generated (max_tokens 0): the echo goes out with the end
      text, lp = self._echo(index, done.prompt_token_ids, done.prompt_logprobs)
    return [self._chunk({"index": index, "text": text, "logprobs": lp, "finish_reason": done.finish_reason})]

  def choice(self, index: int, done: Any) -> dict[str, Any]:
    text, lp = done.text, None
    if self.logprobs: lp = self.spell.legacy(done.logprobs or [], done.token_ids, 0)
    if self.echo:
      prompt, plp = self._echo(index, done.prompt_token_ids, done.prompt_logprobs)
      text = prompt + text
      if lp is not None and plp is not None:
        lp = self.spell.legacy([None, *done.prompt_logprobs, *(done.logprobs or [])], done.prompt_token_ids + done.token_ids, 0)
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": done.finish_reason}


def shaper_for(req: ParsedRequest, model: str, fingerprint: str, tokenizer: Any = None) -> _Shaper:
  kw: dict[str, Any] = {"tokenizer": tokenizer, "n": req.n, "logprobs": req.logprobs}
  if req.kind == CHAT: return ChatShaper(model, fingerprint, req.include_usage, **kw)
  return CompletionShaper(model, fingerprint, req.include_usage, echo=req.echo, prompts=req.prompts, **kw)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def render_json(obj: Any) -> str:
  """The one JSON renderer of every answer, route and stream: UTF-8 text as it is, and a lone surrogate a client sent
  (JSON's `"\\ud800"` decodes to one; UTF-8 cannot carry it) written back as its `\\uXXXX` escape, so no string a
  client sent can fail an answer. A valid pair is one character by now: every surrogate left is lone, and inside a
  string, where the escape is valid JSON."""
  text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
  return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def sse(obj: Any) -> bytes:
  """One server-sent event: `data: <json>\\n\\n` (or `data: [DONE]\\n\\n`)."""
  data = obj if isinstance(obj, str) else render_json(obj)
  return f"data: {data}\n\n".encode()
