"""Structured output: a response_format turned into a grammar (llguidance), and the per-stream matcher that masks the
tail's logits so every answer parses and validates.

The launcher turns a request's `response_format` into a grammar and checks it against the model's vocabulary in the
caller's thread (a bad schema is an InvalidOption naming the field, before anything runs); the grammar goes to the tail
over its control channel (SetGrammar) just before the stream's OPEN record, so the rings keep their small records; the
tail builds the stream's matcher and, before each sample, masks the row's logits with the tokens the
grammar allows (one row at a time: a constrained stream's tokens do not depend on its batch, and unconstrained rows
pay nothing). llguidance computes a mask in tens of microseconds from the GGUF's own vocabulary (token bytes, special
tokens, end tokens), bridged here.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from pyruntime import errors

MAX_SCHEMA_BYTES = 32 << 10   # a schema's JSON
MAX_GRAMMAR_BYTES = 64 << 10  # the grammar made from it, sent to the tail over its control channel (SetGrammar)
# compact JSON: no free whitespace between tokens, so a weak model cannot spend its budget on blanks
JSON_OPTIONS = {"whitespace_flexible": False}
# A grammar's work per token is capped (llguidance's lexer fuel and Earley items per mask: ~15 ms and ~2.5 ms at most,
# at its stated speeds) and so is its build (initial lexer fuel, lexer states, grammar size); a grammar past a cap
# fails at the door or ends its stream with GrammarError. The tail masks one stream's row while every stream's step
# waits, so this is what one stream's grammar can cost the others per token.
LIMITS = {"step_lexer_fuel": 200_000, "step_max_items": 50_000, "initial_lexer_fuel": 1_000_000, "max_lexer_states": 250_000,
          "max_grammar_size": 500_000}


def _limits() -> Any:
  from llguidance import LLParserLimits
  return LLParserLimits(**LIMITS)


_OPENERS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties", "unevaluatedItems")


def closed(schema: Any) -> Any:
  """`schema` with every object that lists `properties` closed (`additionalProperties: false`) unless the schema says
  otherwise (it gives `additionalProperties`, `unevaluatedProperties` or `patternProperties`): what a tool's author
  means, and what OpenAI's strict mode requires. Without it the grammar lets a model add keys nobody named, the same
  key twice among them, and ramble to `length`. An object without `properties` stays free-form."""
  if isinstance(schema, list): return [closed(x) for x in schema]
  if not isinstance(schema, dict): return schema
  out = dict(schema)
  if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPENERS): out["additionalProperties"] = False
  for k in _SUBSCHEMA_LISTS:
    if isinstance(out.get(k), list): out[k] = [closed(x) for x in out[k]]
  for k in _SUBSCHEMA_MAPS:
    if isinstance(out.get(k), dict): out[k] = {name: closed(x) for name, x in out[k].items()}
  for k in _SUBSCHEMAS:
    if isinstance(out.get(k), (dict, list)): out[k] = closed(out[k])
  return out


JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}  # what OpenAI's json_schema format holds


def grammar_for(response_format: Any) -> str | None:
  """The grammar of an OpenAI `response_format` (None: free text). InvalidOption naming what is wrong."""
  if response_format is None: return None
  if not isinstance(response_format, dict): raise errors.InvalidOption("response_format", "must be an object with a 'type'")
  kind = response_format.get("type")
  if kind == "text": return None
  if kind == "json_object":
    # llama.cpp's server and vLLM take a schema here too (instructor's JSON_SCHEMA mode sends it): honoured, never dropped
    schema: Any = response_format.get("schema", {"type": "object"})
    if not isinstance(schema, dict): raise errors.InvalidOption("response_format", "json_object's 'schema' must be a JSON schema object")
  elif kind == "json_schema":
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
      raise errors.InvalidOption("response_format.json_schema", "must be an object whose 'schema' is a JSON schema object")
    if unknown := sorted(set(spec) - JSON_SCHEMA_KEYS):  # a misspelt "shema" would otherwise leave "any JSON"
      keys = ", ".join(sorted(JSON_SCHEMA_KEYS))
      raise errors.InvalidOption(f"response_format.json_schema.{unknown[0]}", f"not a key of a json_schema format ({keys})")
    if not isinstance(schema := spec.get("schema"), dict):
      raise errors.InvalidOption("response_format.json_schema.schema", "a json_schema format needs its schema, a JSON schema object "
                                 "(for any JSON value use type json_object)")
  else: raise errors.InvalidOption("response_format", f"type must be 'text', 'json_object' or 'json_schema', not {str(kind)[:40]!r}")
  text = json.dumps(closed(schema))
  if len(text) > MAX_SCHEMA_BYTES: raise errors.InvalidOption("response_format", f"the schema is over {MAX_SCHEMA_BYTES} bytes")
  from llguidance import LLMatcher
  try: grammar = LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
  except ValueError as e: raise errors.InvalidOption("response_format", f"not a usable JSON schema: {e}") from None
  if len(grammar) > MAX_GRAMMAR_BYTES: raise errors.InvalidOption("response_format", f"the schema's grammar is over {MAX_GRAMMAR_BYTES} bytes")
  return grammar


def vocabulary(tok: Any) -> Any:
  """llguidance's view of a pyruntime Tokenizer (its token bytes, special and end tokens), built once per tokenizer and
  kept on it. A few tenths of a second of Python: the launcher and the tail build it at start (`vocabulary` called
  there), never on a request's path where it would hold the GIL over every stream's tokens."""
  if (v := getattr(tok, "_llguidance", None)) is not None: return v
  from llguidance import LLTokenizer
  from llguidance._tokenizer import TokenizerWrapper

  from pyruntime.text.tokenizer import CONTROL, UNKNOWN, USER_DEFINED

  class GGUFVocabulary:  # what llguidance's TokenizerWrapper reads
    special_token_ids = [i for i in range(tok.vocab_size) if tok.token_type(i) in (CONTROL, USER_DEFINED, UNKNOWN)]
    eos_token_id = tok.eot_id if tok.eot_id is not None else tok.eos_id
    bos_token_id = tok.bos_id
    tokens = [tok.token_bytes(i, special=True) for i in range(tok.vocab_size)]

    def __call__(self, s: bytes | str) -> list[int]:
      return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, parse_special=False)
  v = tok._llguidance = (tok, LLTokenizer(TokenizerWrapper(GGUFVocabulary()), n_vocab=tok.vocab_size, eos_token=sorted(tok.end_ids)))
  return v


MAX_CHECKED = 256  # grammars that passed, kept per vocabulary: a schema a client repeats is checked once


def check(grammar: str, tok: Any, field: str = "response_format") -> None:
  """InvalidOption naming `field` if llguidance cannot build a matcher of `grammar` over this vocabulary."""
  checked: dict[str, None] = tok.__dict__.setdefault("_llguidance_checked", {})
  if grammar in checked: return
  from llguidance import LLMatcher
  is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, vocabulary(tok)[1], limits=_limits())
  if is_error: raise errors.InvalidOption(field, f"the schema cannot be enforced: {messages[0][:300]}")
  # a grammar that builds may still admit nothing: `$ref`s that only refer to each other fail at the first token, and
  # the answer would be empty with finish_reason "stop"
  m = LLMatcher(vocabulary(tok)[1], grammar, limits=_limits())
  m.compute_bitmask()
  if m.is_error() or m.is_stopped():
    why = "its `$ref`s only refer to each other" if "$ref" in grammar or "#/" in grammar else "it accepts only an empty answer"
    detail = f": {m.get_error().splitlines()[0][:160]}" if m.is_error() else ""
    raise errors.InvalidOption(field, f"the schema admits no JSON value ({why}){detail}")
  if len(checked) >= MAX_CHECKED: checked.pop(next(iter(checked)))
  checked[grammar] = None


_worker: Any = None  # the tail's one thread computing streams' next masks (made on first use)


def _mask_worker() -> Any:
  global _worker
  if _worker is None:
    from concurrent.futures import ThreadPoolExecutor
    _worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
  return _worker


class Constraint:
  """One stream's matcher at the tail: `mask()` before a sample, `take(token)` after it, until `done`.

  The next mask is computed as soon as a token is taken, on a worker thread, while that token goes around the pipeline
  (a step of every stage at least): the tail's step waits for a mask only if it took longer than the round trip (its
  work is capped by LIMITS), instead of every stream's step paying for each constrained stream's mask in turn."""

  def __init__(self, grammar: str, tok: Any, vocab_size: int):
    from llguidance import LLMatcher
    self.matcher = LLMatcher(vocabulary(tok)[1], grammar, limits=_limits())
    if self.matcher.is_error(): raise errors.InvalidOption("response_format", self.matcher.get_error()[:300])
    self.vocab_size, self.n_tok = vocab_size, tok.vocab_size
    self.add = np.zeros(vocab_size, np.float32)  # 0 where allowed, -inf elsewhere: added to the row's logits
    self.next: Any = None  # the next mask, being computed (a Future), from take() until mask()
    # the matcher may be touched by one thread at a time (llguidance raises "Already mutably borrowed" otherwise): while
    # the worker computes a mask, `done` answers from what take() saw
    self.stopped = self.matcher.is_stopped()

  def mask(self) -> np.ndarray:
    if self.next is not None:
      fut, self.next = self.next, None
      return fut.result()  # a GrammarError raised on the worker is raised here
    return self._compute()

  def _compute(self) -> np.ndarray:
    raw = self.matcher.compute_bitmask()
    if self.matcher.is_error():  # never an empty answer called finished: the stream ends, saying why
      raise errors.StreamFailed(None, "GrammarError", f"the grammar has no way on: {self.matcher.get_error()[:200]}")
    bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[:self.n_tok]
    self.add[:self.n_tok] = np.where(bits.astype(bool), np.float32(0.0), np.float32(-np.inf))
    self.add[self.n_tok:] = -np.inf  # the model's padding rows past the vocabulary are never text
    return self.add

  @property
  def done(self) -> bool:
    """The answer is whole: the mask now allows only end tokens."""
    return self.stopped and not self.matcher.is_error()  # stopped: no mask is being computed, the matcher is ours

  def take(self, *tokens: int) -> None:
    """The sampled token (or a resumed stream's answer so far, in order) goes into the matcher; the next mask starts at
    once (the previous one was used: the sampler copied it to the device)."""
    for token in tokens:
      if not self.matcher.consume_token(token):
        raise errors.StreamFailed(None, "GrammarViolation", f"token {token} is outside the grammar: {self.matcher.get_error()[:200]}")
    self.stopped = self.matcher.is_stopped()
    if not self.stopped: self.next = _mask_worker().submit(self._compute)

  def close(self) -> None:
    """The stream ended: a mask still being computed is waited for (it uses the matcher), its result dropped."""
    if self.next is not None:
      fut, self.next = self.next, None
      try: fut.result()
      except errors.StreamFailed: pass
