"""Tool calls (pyruntime/text/tools.py, docs/tools.md): tools checked and refused by name; rendered by a template that knows
tools or by the Hermes fallback; calls parsed out of text by family, also when a marker arrives in pieces; every call
the grammar lets through is well formed and validates (a random walk of the masks over a real vocabulary); and through
real stage processes and the official openai client: required, named and auto calls, the round trip call -> tool
result -> answer, streamed deltas that reassemble into the non-streamed response, and the same tokens alone and in a
batch."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from conftest import run_together
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launcher import Delta, Done, Launcher
from pyruntime.text.chat import render_chat, tool_format
from pyruntime.text.grammar import Constraint, check
from pyruntime.text.tokenizer import Tokenizer
from pyruntime.text.tools import FORMATS, ToolCallParser, check_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA = {"get_weather": WEATHER, "get_time": TIME}


def named(name: str) -> dict:
  return {"type": "function", "function": {"name": name}}


# --- checking -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools,choice,parallel,field", [
  ("get_weather", None, None, "tools"),
  ([{"type": "retrieval"}], None, None, "tools[0]"),
  ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools[0].function.name"),
  ([TOOLS[0], TOOLS[0]], None, None, "tools[1].function.name"),
  ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, None, "tools[0].function.parameters"),
  (TOOLS, named("nope"), None, "tool_choice"),
  (TOOLS, "sometimes", None, "tool_choice"),
  (None, "required", None, "tool_choice"),
  (TOOLS, None, "yes", "parallel_tool_calls"),
])
def test_malformed_tools_are_refused_by_name(tools, choice, parallel, field):
  with pytest.raises(errors.InvalidOption) as e: check_tools(tools, choice, parallel)
  assert e.value.field == field


def test_tools_are_checked_into_a_request():
  req = check_tools(TOOLS, named("get_time"), False)
  assert (req.choice, req.name, req.parallel, list(req.parameters)) == ("function", "get_time", False, ["get_weather", "get_time"])
  assert check_tools(TOOLS).choice == "auto" and check_tools(None) is None and check_tools([], "none") is None
  assert not check_tools(TOOLS, "none").calls_allowed


# --- parsing --------------------------------------------------------------------------------------------------------
def parse_in_pieces(fmt: str, text: str, cuts: list[int]) -> tuple[str, list]:
  p, content, calls, last = ToolCallParser(FORMATS[fmt]), [], [], 0
  for c in [*cuts, len(text)]:
    got = p.feed(text[last:c]); content.append(got[0]); calls += got[1]; last = c
  got = p.finish()
  return "".join(content) + got[0], calls + got[1]


HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')


def test_hermes_calls_are_parsed_wherever_the_text_is_cut():
  """Every cut of the text into two deltas, markers split anywhere, gives the same content and calls."""
  want = None
  for cut in range(len(HERMES) + 1):
    content, calls = parse_in_pieces("hermes", HERMES, [cut])
    got = (content, [(c.name, json.loads(c.arguments)) for c in calls])
    want = want or got
    assert got == want, cut
  assert want == ("Let me look.\n", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})])
  content, calls = parse_in_pieces("hermes", HERMES, list(range(len(HERMES))))  # one character at a time
  assert content == "Let me look.\n" and len(calls) == 2 and len({c.id for c in calls}) == 2


@pytest.mark.parametrize("end", ["", "\n", "\n</tool", "</tool_call"])
def test_a_call_whose_json_is_whole_is_a_call_without_its_closing_marker(end):
  """A forced single call ends with its JSON (the grammar), and a budget can cut the closing marker: a call either way.
  A call cut inside its JSON stays text, as written."""
  text = 'x<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}' + end
  for cut in range(len(text) + 1):
    content, calls = parse_in_pieces("hermes", text, [cut])
    assert content == "x" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})], cut
  cut_short = '<tool_call>{"name": "get_time", "arguments": {"zone": "U'
  assert parse_in_pieces("hermes", cut_short, []) == (cut_short, [])


def test_what_is_not_a_call_stays_content():
  for text in ("a < b and <tool_ and <tool_call", "x <tool_call>{not json}</tool_call> y", "cut <tool_call>{\"name\": \"f\", \"argu"):
    assert parse_in_pieces("hermes", text, [3, 9]) == (text, [])


def test_llama3_answers_are_a_call_or_text_from_their_first_character():
  content, calls = parse_in_pieces("llama3", ' {"name": "get_time", "parameters": {"zone": "CET"}}', [4, 20])
  assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]
  content, calls = parse_in_pieces("llama3", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', [7])
  assert [c.name for c in calls] == ["a", "b"] and content == ""
  assert parse_in_pieces("llama3", 'It is {"name": "f"} sunny.', [2]) == ('It is {"name": "f"} sunny.', [])


def test_dsml_blocks_are_parsed_and_rendered_back():
  call = [{"function": {"name": "get_weather", "arguments": {"city": "Hangzhou", "days": 3}}}]
  text = "Checking.\n" + FORMATS["dsml"].render(call)
  content, calls = parse_in_pieces("dsml", text, [12, 30])
  assert content == "Checking.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Hangzhou", "days": 3})]


# --- rendering ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return write_tiny_gguf(tmp_path_factory.mktemp("tools") / "llama.gguf", **{**TINY_MODELS["llama_tied"], "context": 2048})


def round_trip_messages(calls: list[dict]) -> list[dict]:
  return [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": calls},
          *({"role": "tool", "tool_call_id": c["id"], "content": f"result {i}"} for i, c in enumerate(calls))]


CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]


def test_a_chatml_template_without_tools_gets_the_hermes_fallback(tiny):
  tok = Tokenizer.from_gguf(tiny)
  assert tool_format(tok) == (FORMATS["hermes"], False)
  text = render_chat(tok, round_trip_messages(CALLS), tools=check_tools(TOOLS))
  assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOLS[0]) in text
  assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in text
  assert "<|im_start|>user\n<tool_response>\nresult 0\n</tool_response>\n<tool_response>\nresult 1\n</tool_response><|im_end|>" in text
  assert "# Tools" not in render_chat(tok, round_trip_messages(CALLS), tools=check_tools(TOOLS, "none"))  # none: not offered


KNOWS_TOOLS = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
               "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
               "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_a_template_that_knows_tools_renders_them_itself(tiny):
  tok = Tokenizer.from_gguf(tiny)
  assert tool_format(tok, KNOWS_TOOLS) == (FORMATS["hermes"], True)
  text = render_chat(tok, round_trip_messages(CALLS[:1]), tools=check_tools(TOOLS), template=KNOWS_TOOLS)
  assert text.startswith("TOOLS:get_weather;get_time;<|im_start|>user")
  assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in text


def test_a_model_that_cannot_take_tools_is_refused_by_name(tiny):
  tok = Tokenizer.from_gguf(tiny)
  with pytest.raises(errors.UnsupportedFeature) as e:
    render_chat(tok, [{"role": "user", "content": "hi"}], tools=check_tools(TOOLS), template="{% for m in messages %}{{ m.content }}{% endfor %}")
  assert e.value.feature == "tools"


@pytest.mark.parametrize("where,bad,field", [
  (1, {"role": "user", "content": "x", "tool_calls": CALLS}, "messages[1].tool_calls"),
  (1, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, "messages[1].tool_calls[0].function.arguments"),
  (1, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "messages[1].tool_calls[0]"),
])
def test_malformed_tool_calls_in_messages_are_refused_by_name(tiny, where, bad, field):
  msgs = [{"role": "user", "content": "hi"}, bad]
  with pytest.raises(errors.InvalidOption) as e: render_chat(Tokenizer.from_gguf(tiny), msgs)
  assert e.value.field == field


# --- the grammar: every call it lets through is well formed ----------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", "get_time", "get_weather", "auto"])
def test_a_random_walk_of_the_tool_masks_gives_well_formed_calls(tiny, choice):
  tok = Tokenizer.from_gguf(tiny)
  req = check_tools(TOOLS, named(choice) if choice in SCHEMA else choice, False)
  grammar = FORMATS["hermes"].grammar(req, tok)
  check(grammar, tok, "tools")
  for seed in range(3):
    rng, c, out = np.random.default_rng(seed), Constraint(grammar, tok, tok.vocab_size), []
    if choice == "auto":  # text first, then the model opens a call: the grammar takes over from the marker on
      for t in tok.encode("Sure. <tool_call>", parse_special=False): c.take(t); out.append(t)
    for _ in range(400):
      if c.done: break
      allowed = np.flatnonzero(c.mask() == 0)
      t = int(rng.choice(allowed))
      if t in tok.end_ids: break
      c.take(t); out.append(t)
    content, calls = parse_in_pieces("hermes", tok.decode(out), [])
    assert c.done and len(calls) == 1, tok.decode(out)
    assert calls[0].name == choice if choice in SCHEMA else calls[0].name in SCHEMA
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA[calls[0].name])


def test_a_marker_that_is_one_special_token_is_used_as_that_token(tiny):
  """Qwen's vocabulary has <tool_call> as one added token: the grammar must let the model write that token."""
  tok = Tokenizer.from_gguf(tiny)
  marker = tok.token_text(tok.eos_id)  # a special token of this vocabulary, standing in for such a marker
  fmt = type("SpecialMarker", (type(FORMATS["hermes"]),), {"open": marker})()
  grammar = fmt.grammar(check_tools(TOOLS, "required"), tok)
  assert f"<[{tok.eos_id}]>" in grammar
  c = Constraint(grammar, tok, tok.vocab_size)
  assert np.flatnonzero(c.mask() == 0).tolist() == [tok.eos_id]


# --- through stage processes -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(tiny):
  with Launcher(tiny, stages=2, max_context=2048) as launcher:
    yield launcher


def ask(lm: Launcher, messages: list[dict] | None = None, **kw) -> tuple[list[Delta], Done]:
  kw.setdefault("max_tokens", 120)
  evs = list(lm.generate(messages=messages or [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, **kw))
  return evs[:-1], evs[-1]


@pytest.mark.integration
@pytest.mark.parametrize("choice", ["required", "get_weather", "get_time"])
def test_required_and_named_calls_are_whole_and_valid(lm, choice):
  for sampling in ({}, {"temperature": 1.0, "seed": 5}):
    deltas, d = ask(lm, tool_choice=named(choice) if choice in SCHEMA else choice, parallel_tool_calls=False, **sampling)
    assert d.finish_reason == "tool_calls" and len(d.tool_calls) == 1 and d.text.strip() == "", d
    call = d.tool_calls[0]
    assert call.name == choice if choice in SCHEMA else call.name in SCHEMA
    jsonschema.validate(json.loads(call.arguments), SCHEMA[call.name])
    assert [c for x in deltas for c in x.tool_calls] == d.tool_calls and "".join(x.text for x in deltas) == d.text
    assert "</tool_call>" not in lm.tokenizer.decode(d.token_ids)  # one call may come: the answer ends with its JSON


@pytest.mark.integration
def test_a_round_trip_call_then_result_then_answer(lm):
  _, first = ask(lm, tool_choice="required", parallel_tool_calls=False)
  calls = [c.to_openai() for c in first.tool_calls]
  _, answer = ask(lm, round_trip_messages(calls), tool_choice="none", max_tokens=20)
  assert answer.tool_calls == [] and answer.finish_reason in ("stop", "length") and answer.token_ids
  assert "<tool_response>" in lm.tokenizer.decode(answer.prompt_token_ids)


@pytest.mark.integration
def test_auto_either_answers_or_calls_well_formed(lm):
  for seed in range(2):
    _, d = ask(lm, temperature=1.0, seed=seed, max_tokens=80)
    assert d.finish_reason in ("stop", "length", "tool_calls")
    for c in d.tool_calls: jsonschema.validate(json.loads(c.arguments), SCHEMA[c.name])
    assert "<tool_call>" not in d.text or d.finish_reason == "length"  # only a call cut by the budget stays as text


@pytest.mark.integration
def test_calls_are_the_same_alone_and_beside_others(lm):
  """Four streams (a batch of eight constrained streams is test_structured's: the same masks at the tail)."""
  kw = {i: {"tool_choice": "required", "max_tokens": 60, **({"temperature": 0.9, "seed": i} if i % 2 else {})} for i in range(4)}
  alone = {i: ask(lm, **kw[i])[1].token_ids for i in range(4)}
  assert run_together(lambda i: ask(lm, **kw[i])[1].token_ids, 4) == alone


@pytest.mark.integration
def test_tools_and_a_response_format_or_logits_are_refused_by_name(lm):
  with pytest.raises(errors.InvalidOption) as e: lm.submit(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                                           response_format={"type": "json_object"}, on_event=print)
  assert e.value.field == "response_format"
  with pytest.raises(errors.InvalidOption) as e: lm.submit("x", raw=True, tools=TOOLS, on_event=print)
  assert e.value.field == "tools"


@pytest.mark.integration
def test_the_openai_client_streams_calls_that_reassemble_into_the_response(lm):
  import openai

  from pyruntime.serving.httpd import BackgroundServer
  from pyruntime.serving.server import create_app
  with BackgroundServer(create_app(lm)) as srv:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model="default", messages=msgs, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    streamed: dict[int, dict] = {}
    finish = None
    for ch in c.chat.completions.create(model="default", messages=msgs, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, stream=True):
      for tc in ch.choices[0].delta.tool_calls or []:
        s = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
        s["name"] += tc.function.name or ""; s["arguments"] += tc.function.arguments or ""
      finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    want = [{"name": t.function.name, "arguments": t.function.arguments} for t in choice.message.tool_calls]
    assert [streamed[i] for i in sorted(streamed)] == want
    # the round trip through the client: the call goes back with its result
    follow = msgs + [choice.message.model_dump(exclude_none=True)] + [
      {"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in choice.message.tool_calls]
    r2 = c.chat.completions.create(model="default", messages=follow, tools=TOOLS, max_tokens=20)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as e:
      c.chat.completions.create(model="default", messages=msgs, tools=TOOLS, tool_choice=named("nope"))
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deeply_nested_arguments_are_refused_by_name(tiny, depth):
  """An assistant message's tool call whose arguments are nested deeper than a parser or the template goes: a 400
  naming the field, never a 500 (RecursionError)."""
  from pyruntime.serving.openai_api import error_body, parse_request
  from pyruntime.text.chat import build_prompt_ids, validate_messages
  args = '{"a":' * depth + "1" + "}" * depth
  messages = [{"role": "user", "content": "hi"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
  body = {"messages": messages, "max_tokens": 4}
  try:
    parse_request(body, "chat")
    from pyruntime.modelfile.gguf import read_header
    kv = read_header(tiny).kv
    build_prompt_ids(Tokenizer.from_gguf_kv(kv), kv, messages=validate_messages(messages))
    raise AssertionError("accepted")
  except (errors.InvalidOption, errors.ContextLengthExceeded) as e:  # the latter where a raised recursion limit parses it
    status, err = error_body(e, "chat")
    assert status == 400 and err["error"]["param"] in ("messages[1].tool_calls[0].function.arguments", "messages"), err
