"""Structured output (response_format, pyruntime/text/grammar.py): every answer parses and validates against its schema —
under a random walk of the grammar's masks over a real GGUF vocabulary (20 schemas), and through real stage processes
on a tiny model (each of the 20 within 96 tokens), greedy and seeded, streamed and not, through the official openai
client; a constrained stream's tokens are the same alone and beside others; bad schemas are refused by name before
anything runs."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from conftest import run_together
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launcher import Done, Launcher
from pyruntime.text.grammar import Constraint, check, grammar_for
from pyruntime.text.tokenizer import Tokenizer

S = {"type": "string", "maxLength": 8}
SCHEMAS = [
  {"type": "object", "properties": {"a": S}, "required": ["a"], "additionalProperties": False},
  {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"], "additionalProperties": False},
  {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["x"], "additionalProperties": False},
  {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
  {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"], "additionalProperties": False},
  {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"], "additionalProperties": False},
  {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                                                 "maxItems": 3}}, "required": ["l"], "additionalProperties": False},
  {"type": "object", "properties": {"t": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["t"],
   "additionalProperties": False},
  {"type": "object", "properties": {"in": {"type": "object", "properties": {"k": S}, "required": ["k"], "additionalProperties": False}},
   "required": ["in"], "additionalProperties": False},
  {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-z]{2,4}$"}}, "required": ["p"], "additionalProperties": False},
  {"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}}, "required": ["d"], "additionalProperties": False},
  {"type": "object", "properties": {"a": S, "b": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["a"], "additionalProperties": False},
  {"type": "object", "properties": {"o": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]}}, "required": ["o"],
   "additionalProperties": False},
  {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
   "maximum": 9}}, "required": ["id"], "additionalProperties": False}, "maxItems": 2}}, "required": ["m"], "additionalProperties": False},
  {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
  {"type": "integer", "minimum": 10, "maximum": 20},
  {"enum": ["yes", "no", "maybe"]},
  {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
   "required": ["name", "age", "tags"], "additionalProperties": False},
  {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"], "additionalProperties": False},
  {"type": "object", "properties": {"deep": {"type": "object", "properties": {"deeper": {"type": "object", "properties": {"z": {"type": "boolean"}},
   "required": ["z"], "additionalProperties": False}}, "required": ["deeper"], "additionalProperties": False}}, "required": ["deep"],
   "additionalProperties": False},
]


def fmt(schema: dict) -> dict:
  return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return write_tiny_gguf(tmp_path_factory.mktemp("structured") / "llama.gguf", **TINY_MODELS["llama_tied"])


# --- the grammar alone, over the tiny model's real vocabulary ---------------------------------------------------------
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_a_random_walk_of_the_masks_always_gives_a_valid_answer(tiny, i):
  """Any token the mask allows, picked at random, 3 seeds: the text parses and validates when the grammar is done."""
  tok = Tokenizer.from_gguf(tiny)
  grammar = grammar_for(fmt(SCHEMAS[i]))
  check(grammar, tok)
  for seed in range(3):
    rng, c, out = np.random.default_rng(seed), Constraint(grammar, tok, tok.vocab_size + 3), []
    for _ in range(400):
      allowed = np.flatnonzero(c.mask() == 0)
      assert allowed.size and allowed.max() < tok.vocab_size  # never a padding row of the model's output
      if c.done:
        assert set(allowed) <= set(tok.end_ids)  # a whole answer: only an end token may follow
        break
      t = int(rng.choice(allowed))
      c.take(t)
      out.append(t)
    assert c.done, f"schema {i} seed {seed}: no whole answer in 400 tokens: {tok.decode(out)!r}"
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMAS[i])


@pytest.mark.parametrize("bad", ["json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": [1]}},
                                 {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}},
                                 {"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 40000]}}}])
def test_a_schema_that_cannot_be_enforced_is_refused_by_name(tiny, bad):
  tok = Tokenizer.from_gguf(tiny)
  with pytest.raises(errors.InvalidOption) as e:
    grammar = grammar_for(bad)
    check(grammar, tok)  # some are only found against a vocabulary
  assert e.value.field.startswith("response_format"), e.value.field


def walk(grammar: str, tok: Tokenizer, seed: int, limit: int, closing_bias: float = 0.0) -> tuple[bool, list[int]]:
  """Tokens the masks allow, picked at random (with `closing_bias`, a closing bracket that often when one is allowed, so
  an open recursion ends), until the grammar is done or `limit` tokens: (done, tokens)."""
  rng, c, out = np.random.default_rng(seed), Constraint(grammar, tok, tok.vocab_size), []
  while not c.done and len(out) < limit:
    allowed = np.flatnonzero(c.mask() == 0)
    closing = [t for t in allowed if tok.decode([int(t)]).strip() in ("}", "]", "}]", "]}", "}}")] if closing_bias else []
    out.append(int(closing[0] if closing and rng.random() < closing_bias else rng.choice(allowed)))
    c.take(out[-1])
  return c.done, out


RECURSIVE_OK = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["value"]}
MUTUAL_OK = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},
                                            "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "maxItems": 2}}}


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}],
                         ids=["itself", "each-other"])
def test_refs_that_only_refer_to_each_other_are_refused_not_answered_empty(tiny, schema):
  """Such a schema admits no JSON value: it was answered "" with finish_reason "stop"; now a 400 that names `$ref`."""
  tok = Tokenizer.from_gguf(tiny)
  with pytest.raises(errors.InvalidOption) as e: check(grammar_for(fmt(schema)), tok)
  assert e.value.field == "response_format" and "$ref" in str(e.value)


@pytest.mark.parametrize("schema", [RECURSIVE_OK, MUTUAL_OK], ids=["self", "mutual"])
def test_recursive_schemas_with_a_way_out_are_enforced(tiny, schema):
  """llguidance follows `$ref` recursion: a random walk of the masks ends in an answer that validates."""
  tok = Tokenizer.from_gguf(tiny)
  grammar = grammar_for(fmt(schema))
  check(grammar, tok)
  finished = 0
  for seed in range(3):
    done, out = walk(grammar, tok, seed, 600, closing_bias=0.7)
    if done:
      jsonschema.validate(json.loads(tok.decode(out)), schema)
      finished += 1
  assert finished >= 1


def test_objects_that_name_their_properties_are_closed_unless_the_schema_opens_them():
  from pyruntime.text.grammar import closed
  schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                             "free": {"type": "object"},
                                             "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
                                             "list": {"type": "array", "items": {"properties": {"y": {}}}}},
            "$defs": {"d": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]}}}
  c = closed(schema)
  assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
  assert "additionalProperties" not in c["properties"]["free"]                  # free-form: no properties named
  assert c["properties"]["open"]["additionalProperties"] is True                # the schema opened it
  assert c["properties"]["list"]["items"]["additionalProperties"] is False
  assert c["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
  assert "additionalProperties" not in schema                                  # the caller's schema is not changed


def test_a_walk_never_adds_keys_the_schema_did_not_name(tiny):
  """The grammar of a schema whose objects list their properties admits no other key (and none twice)."""
  from pyruntime.text.grammar import closed
  tok = Tokenizer.from_gguf(tiny)
  schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}, "required": ["city"]}
  grammar = grammar_for(fmt(schema))
  for seed in range(4):
    done, out = walk(grammar, tok, seed, 200)
    assert done
    jsonschema.validate(json.loads(tok.decode(out)), closed(schema))


def test_json_object_with_a_schema_is_that_schema():
  """instructor's JSON_SCHEMA mode (and llama.cpp's and vLLM's servers): the schema is honoured, never dropped."""
  schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
  assert grammar_for({"type": "json_object", "schema": schema}) == grammar_for(fmt(schema)) != grammar_for({"type": "json_object"})
  with pytest.raises(errors.InvalidOption): grammar_for({"type": "json_object", "schema": "not a schema"})


# Every keyword family the grammar engine enforces, and every one it refuses (llguidance 1.9: "Unimplemented keys"):
# a schema with an unenforced keyword is refused by name, never answered as if the keyword were not there.
CLAIMED = {
  "type+enum+const": {"type": "object", "properties": {"t": {"enum": ["a", "b", 3]}, "c": {"const": {"x": 1}}}, "required": ["t", "c"]},
  "string bounds+pattern": {"type": "string", "minLength": 2, "maxLength": 8, "pattern": "^[a-c]+$"},
  "formats": {"type": "object", "properties": {"d": {"type": "string", "format": "date"}, "u": {"type": "string", "format": "uuid"},
                                               "e": {"type": "string", "format": "email"}}, "required": ["d", "u", "e"]},
  "numbers": {"type": "object", "properties": {"i": {"type": "integer", "minimum": -5, "maximum": 5},
                                               "n": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                                               "m": {"type": "integer", "multipleOf": 3}}, "required": ["i", "n", "m"]},
  "arrays": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 4}], "items": {"type": "boolean"},
             "minItems": 2, "maxItems": 4},
  "objects": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "patternProperties": {"^x": {"type": "boolean"}}},
  "combinators": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}}, "required": ["k"]}],
                  "$defs": {"unused": {"type": "null"}}},
  "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}]},
}
REFUSED = {"uniqueItems": {"type": "array", "uniqueItems": True}, "not": {"not": {"type": "string"}},
           "if": {"if": {"type": "integer"}, "then": {"minimum": 0}}, "contains": {"type": "array", "contains": {"type": "integer"}},
           "dependentRequired": {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
           "propertyNames": {"type": "object", "propertyNames": {"pattern": "^a"}},
           # oneOf only where its branches cannot overlap (llguidance; anyOf otherwise)
           "oneOf": {"oneOf": [{"properties": {"a": {"maximum": 0}}}, {"properties": {"a": {"minimum": 1}}}]},
           # min/maxProperties only with every listed property required
           "maxProperties": {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^x": {}}, "maxProperties": 2}}


@pytest.mark.parametrize("family", sorted(CLAIMED))
def test_every_keyword_family_claimed_validates(tiny, family):
  from pyruntime.text.grammar import closed
  tok, schema = Tokenizer.from_gguf(tiny), CLAIMED[family]
  grammar = grammar_for(fmt(schema))
  check(grammar, tok)
  finished = 0
  for seed in range(4):
    done, out = walk(grammar, tok, seed, 300)
    if done:
      answer = json.loads(tok.decode(out))
      # `format: date` is enforced by its shape (YYYY-MM-DD, a day up to the month's longest): Feb 29 of any year passes
      jsonschema.validate(answer, closed(schema), format_checker=jsonschema.FormatChecker(formats=("email", "uuid")))
      if family == "formats": assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", answer["d"]), answer
      finished += 1
  assert finished >= 2, f"{family}: {finished} of 4 walks ended within 300 tokens"


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_every_keyword_not_enforced_is_refused_by_name(tiny, keyword):
  with pytest.raises(errors.InvalidOption) as e: check(grammar_for(fmt(REFUSED[keyword])), Tokenizer.from_gguf(tiny))
  assert e.value.field == "response_format" and keyword in str(e.value)


def test_free_text_has_no_grammar():
  assert grammar_for(None) is None and grammar_for({"type": "text"}) is None


# --- through stage processes ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(tiny):
  with Launcher(tiny, stages=2, max_context=512) as launcher:
    yield launcher


def answer(lm: Launcher, schema: dict, **kw) -> Done:
  kw.setdefault("max_tokens", 96)  # every schema here is bounded: its answer closes within 96 tokens (issue #37's bound)
  return next(ev for ev in lm.generate("Give me the answer.", raw=True, response_format=fmt(schema), **kw) if isinstance(ev, Done))


@pytest.mark.integration
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_answers_parse_and_validate_greedy_and_seeded(lm, i):
  for sampling in ({}, {"temperature": 0.9, "seed": 3}, {"temperature": 1.3, "top_k": 50, "seed": 4}):
    d = answer(lm, SCHEMAS[i], **sampling)
    assert d.finish_reason == "stop", (d.finish_reason, d.text)
    jsonschema.validate(json.loads(d.text), SCHEMAS[i])


@pytest.mark.integration
def test_a_whole_answer_ends_the_stream_even_with_ignore_eos_and_a_cut_one_says_length(lm):
  d = answer(lm, SCHEMAS[17], ignore_eos=True)
  jsonschema.validate(json.loads(d.text), SCHEMAS[17])
  cut = answer(lm, SCHEMAS[17], max_tokens=3)
  assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and d.text.startswith(cut.text)


@pytest.mark.integration
def test_constrained_streams_give_the_same_tokens_alone_and_beside_others(lm):
  kw = {i: dict(**({"temperature": 0.8, "seed": i} if i % 2 else {})) for i in range(8)}
  alone = {i: answer(lm, SCHEMAS[i], **kw[i]).token_ids for i in range(8)}
  assert run_together(lambda i: answer(lm, SCHEMAS[i], **kw[i]).token_ids, 8) == alone


@pytest.mark.integration
def test_logits_and_a_grammar_do_not_mix(lm):
  with pytest.raises(errors.InvalidOption) as e: lm.submit("x", raw=True, logits=True, response_format=fmt(SCHEMAS[0]), on_event=print)
  assert e.value.field == "response_format"


@pytest.mark.integration
def test_the_openai_client_gets_valid_answers_streamed_and_not(lm):
  import openai

  from pyruntime.serving.httpd import BackgroundServer
  from pyruntime.serving.server import create_app
  with BackgroundServer(create_app(lm)) as srv:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    for i in (0, 4, 11, 18):
      msgs = [{"role": "user", "content": "Answer in JSON."}]
      r = c.chat.completions.create(model="default", messages=msgs, max_tokens=300, response_format=fmt(SCHEMAS[i]))
      jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])
      parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="default", messages=msgs, max_tokens=300, response_format=fmt(SCHEMAS[i]), stream=True) if ch.choices]
      assert "".join(parts) == r.choices[0].message.content
    # any object: keys and strings without bounds, which a tiny random model may not close within its budget
    r = c.chat.completions.create(model="default", messages=msgs, max_tokens=300, response_format={"type": "json_object"})
    content = r.choices[0].message.content
    assert content.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict)), r
    with pytest.raises(openai.BadRequestError) as e:
      c.chat.completions.create(model="default", messages=msgs, response_format={"type": "json_schema", "json_schema": {"schema": 3}})
    assert e.value.param == "response_format.json_schema.schema"



def test_the_next_mask_is_computed_ahead_and_equals_the_one_computed_in_turn(tiny):
  """take() starts the next mask on the worker (overlapped with the token's trip around the pipeline); what mask() then
  returns is the mask computed in turn, step by step."""
  tok = Tokenizer.from_gguf(tiny)
  grammar = grammar_for(fmt(SCHEMAS[0]))
  ahead, in_turn = Constraint(grammar, tok, tok.vocab_size), Constraint(grammar, tok, tok.vocab_size)
  rng = np.random.default_rng(5)
  for _ in range(60):
    m = ahead.mask().copy()
    assert np.array_equal(m, in_turn._compute())
    if ahead.done: break
    t = int(rng.choice(np.flatnonzero(m == 0)))
    ahead.take(t)
    assert ahead.next is not None or ahead.matcher.is_stopped()  # the next one is under way
    assert in_turn.matcher.consume_token(t)
  ahead.close()
  assert ahead.next is None
