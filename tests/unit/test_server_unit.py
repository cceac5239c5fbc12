"""The OpenAI-compatible server's HTTP behaviour, against a scripted stand-in for the launcher.

`FakeLauncherForUnitTests` exists only here: it keeps `Launcher.submit`'s contract (validation
before anything runs, events handed to `on_event` from another thread, first come first served,
`cancel()`) with one stream at a time (`max_streams = 1`), but "generates" by
repeating the prompt's words, so these tests run in seconds and can hold, slow down or break a
generation on purpose. The real model is exercised end to end in tests/integration/test_server.py.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from conftest import sample, scrape

from pyruntime import errors, params
from pyruntime.engine.launcher import Delta, Done, Timings, Usage
from pyruntime.serving import openai_api as api
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.metrics import parse_expert_load
from pyruntime.serving.server import create_app

SAMPLING = set(params.SAMPLING)


class FakeLauncherForUnitTests:
  """A test double for pyruntime.launcher.Launcher (unit tests only). The completion of a prompt is
  its own words, one per token, cycled: "a b c" → "a b c a b" for max_tokens=5."""
  model_name = "fake-smol"
  context_length = 1000
  split = [(0, 15), (15, 30)]
  recipe = "fakerecipe000001"
  max_streams = 1
  tokenizer = None  # the tokenizer routes check their fields before they use it

  def __init__(self) -> None:
    self.lock = threading.Lock()          # one generation at a time, like the launcher's
    self.calls: list[dict[str, Any]] = []   # generate()'s arguments, per call
    self.started: list[str] = []          # prompt texts, in the order their generation began
    self.ended: list[tuple[str, int, bool]] = []   # (prompt text, tokens produced, reached Done)
    self.ended_event = threading.Event()
    self.running = threading.Event()
    self.gate = threading.Event(); self.gate.set()  # clear it to hold every generation before its next token
    self.token_delay = 0.0
    self.fail: tuple[int, BaseException] | None = None   # raise this after that many tokens
    self._alive = [True, True]
    self._closed = False
    self.turns = threading.Condition()      # streams run one at a time, in the order they were submitted
    self.tickets, self.now_serving, self.waiting = 0, 0, 0

  def submit(self, prompt: str | None = None, messages: list[dict] | None = None, *, on_event: Any, n: int = 1,
             prompt_ids: list[int] | None = None, **options: Any) -> Any:
    if prompt_ids is not None: prompt = " ".join(f"t{i}" for i in prompt_ids)  # token ids "spelled" as words
    if n > 1: return [self.submit(prompt, messages, on_event=lambda ev, i=i: on_event(i, ev), **options) for i in range(n)]
    gen = self.generate(prompt, messages, **options)  # validates and raises before anything is queued, like the launcher
    handle = FakeStream(self)
    with self.turns:
      ticket, self.tickets, self.waiting = self.tickets, self.tickets + 1, self.waiting + 1

    def run() -> None:
      with self.turns:
        while self.now_serving != ticket: self.turns.wait()
        if not handle.cancelled.is_set(): self.waiting -= 1  # a cancelled one left the queue already
        handle.started = True
      try:
        if handle.cancelled.is_set(): return
        for ev in gen:
          if handle.cancelled.is_set(): return
          on_event(ev)
      except Exception as e:  # noqa: BLE001 - like the launcher: the stream's error is its last event
        on_event(e)
      finally:
        gen.close()
        with self.turns:
          self.now_serving += 1
          self.turns.notify_all()
    threading.Thread(target=run, daemon=True).start()
    return handle

  def scheduler_stats(self) -> dict:
    with self.turns: return {"running": int(self.running.is_set()), "waiting": self.waiting, "max_streams": self.max_streams}

  def alive(self) -> list[bool]: return list(self._alive)
  def serving(self) -> bool: return not self._closed

  def stage_view(self) -> list[dict]:
    """Heartbeats as a launcher keeps them: stage 0 busy 0.6 s of every second at 4 rows per step, stage 1 idle."""
    now = time.monotonic()
    t = round(now, 1)  # a beat every 0.1 s
    return [{"stage": i, "pid": 100 + i, "alive": a, "layers": list(self.split[i]), "device": "CPU", "resident_bytes": 1 << 20,
             "beat": {"t": t, "steps": int(t * 10), "tokens": int(t * 10) * (4 if i == 0 else 0), "busy_s": t * (0.6 if i == 0 else 0.0)}}
            for i, a in enumerate(self._alive)]

  def ring_occupancy(self) -> list[float]:
    if self._closed: raise errors.LauncherClosed("closed")
    return [0.0, 0.25, 0.5]

  def expert_load(self) -> list[list[int] | None]: return [[3, 0, 5], None]   # a 3-expert MoE cut after its head

  def close(self) -> None:
    self._closed, self._alive = True, [False, False]

  def generate(self, prompt: str | None = None, messages: list[dict] | None = None, *, raw: bool = False, max_tokens: int | None = 256,
               stop: Any = None, **sampling: Any) -> Any:
    if self._closed: raise errors.LauncherClosed("the launcher is not running")
    if unknown := set(sampling) - SAMPLING: raise errors.UnsupportedFeature(sorted(unknown)[0])
    self.calls.append(dict(prompt=prompt, messages=messages, raw=raw, max_tokens=max_tokens, stop=stop, **sampling))
    if raw: text = prompt
    else:
      text = " ".join(m["content"] if isinstance(m["content"], str) else " ".join(p["text"] for p in m["content"]) for m in messages)
    words = text.split()
    if not words: raise errors.EmptyPrompt()
    if len(words) >= self.context_length: raise errors.ContextLengthExceeded(len(words), self.context_length)
    n = min(max_tokens or self.context_length, self.context_length - len(words))
    return self._run(text, words, n)

  def _run(self, text: str, words: list[str], n: int) -> Any:
    with self.lock:
      self.started.append(text)
      self.running.set()
      produced, finished, out = 0, False, []
      try:
        for i in range(n):
          if not self.gate.wait(20): raise TimeoutError("the test never opened the gate")
          if self.token_delay: time.sleep(self.token_delay)
          if self.fail is not None and i == self.fail[0]:
            if isinstance(self.fail[1], errors.StageFailed): self.close()
            raise self.fail[1]
          piece = (" " if i else "") + words[i % len(words)]
          out.append(piece); produced += 1
          yield Delta(piece, [i])
        finished = True
        yield Done("length", Usage(len(words), n), Timings(0.1, 0.01, 50.0, 0.2), list(range(len(words))), list(range(n)), "".join(out))
      finally:
        self.running.clear()
        self.ended.append((text, produced, finished))
        self.ended_event.set()


class FakeStream:
  def __init__(self, fake: FakeLauncherForUnitTests) -> None:
    self.fake, self.cancelled, self.started = fake, threading.Event(), False

  def cancel(self) -> None:
    with self.fake.turns:
      if not self.started and not self.cancelled.is_set(): self.fake.waiting -= 1
      self.cancelled.set()


def expected(prompt: str, n: int) -> str:
  words = prompt.split()
  return " ".join(words[i % len(words)] for i in range(n))


@pytest.fixture
def fake() -> FakeLauncherForUnitTests:
  return FakeLauncherForUnitTests()


@pytest.fixture
def make_server(fake):
  servers: list[BackgroundServer] = []

  def make(queue_size: int = 16) -> tuple[BackgroundServer, httpx.Client]:
    srv = BackgroundServer(create_app(fake, queue_size=queue_size)).start()
    servers.append(srv)
    return srv, httpx.Client(base_url=srv.url, timeout=20)
  yield make
  fake.gate.set()
  for s in servers: s.stop()


@pytest.fixture
def server(make_server):
  return make_server()


@pytest.fixture(scope="module")
def shared_server():
  """One server for the many requests that must be refused before anything runs."""
  fake = FakeLauncherForUnitTests()
  srv = BackgroundServer(create_app(fake)).start()
  try: yield fake, srv, httpx.Client(base_url=srv.url, timeout=20)
  finally: srv.stop()


def chat(content: str = "hello there world", **kw: Any) -> dict[str, Any]:
  return {"model": "fake-smol", "messages": [{"role": "user", "content": content}], **kw}


def sse_events(body: str) -> list[str]:
  """The data of each server-sent event, insisting on exact `data: ...\\n\\n` framing."""
  assert body.endswith("\n\n"), repr(body[-50:])
  events = body[:-2].split("\n\n")
  for e in events: assert re.fullmatch(r"data: [^\n]+", e), repr(e)
  return [e[len("data: "):] for e in events]


def wait_for(cond: Any, timeout: float = 10.0) -> None:
  deadline = time.monotonic() + timeout
  while not cond():
    assert time.monotonic() < deadline, "timed out waiting"
    time.sleep(0.01)


def in_thread(fn: Any, *args: Any, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
  box: dict[str, Any] = {}
  def run() -> None:
    try: box["result"] = fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
      box["error"] = e
  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t, box


# --- pure request parsing -------------------------------------------------------------------------
def test_parse_chat_maps_fields():
  r = api.parse_request(chat(max_completion_tokens=7, stop="x", temperature=0.5, seed=3, top_k=4, user="u", stream=True,
                             stream_options={"include_usage": True}), api.CHAT)
  assert r.stream and r.include_usage and r.model == "fake-smol"
  assert r.generate == {"messages": [{"role": "user", "content": "hello there world"}], "max_tokens": 7, "stop": ["x"],
                        "temperature": 0.5, "seed": 3, "top_k": 4}


def test_parse_completion_defaults_and_prompt_list():
  r = api.parse_request({"prompt": ["Once upon"]}, api.COMPLETION)
  assert r.generate == {"raw": True, "max_tokens": 16} and r.prompts == ["Once upon"] and r.choices == 1 and not r.stream
  r = api.parse_request({"prompt": [[1, 2], [3]], "n": 2}, api.COMPLETION)  # a batch of token-id prompts, two choices each
  assert r.prompts == [[1, 2], [3]] and r.choices == 4
  assert api.parse_request({"prompt": [5, 6]}, api.COMPLETION).prompts == [[5, 6]]
  r = api.parse_request({"prompt": "x", "max_tokens": 3, "logprobs": None, "echo": False, "best_of": 1}, api.COMPLETION)
  assert r.generate["max_tokens"] == 3


def test_parse_chat_without_max_tokens_runs_to_the_context():
  assert api.parse_request(chat(), api.CHAT).generate["max_tokens"] is None


# --- shapes -----------------------------------------------------------------------------------------
def test_models(server):
  _, c = server
  r = c.get("/v1/models")
  assert r.status_code == 200
  body = r.json()
  assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["fake-smol"] and body["data"][0]["object"] == "model"
  assert c.get("/v1/models/fake-smol").json()["id"] == "fake-smol"
  assert c.get("/v1/models/other").json()["error"]["code"] == "model_not_found"


def test_chat_completion_shape(server, fake):
  _, c = server
  r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
  assert r.status_code == 200, r.text
  b = r.json()
  assert b["id"].startswith("chatcmpl-") and b["object"] == "chat.completion" and isinstance(b["created"], int)
  assert b["model"] == "fake-smol" and b["system_fingerprint"] == "fakerecipe000001"
  assert b["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello there world hello there"}, "logprobs": None,
                           "finish_reason": "length"}]
  assert b["usage"]["prompt_tokens"] == 3 and b["usage"]["completion_tokens"] == 5 and b["usage"]["total_tokens"] == 8
  assert fake.calls[-1]["raw"] is False and fake.calls[-1]["messages"] == [{"role": "user", "content": "hello there world"}]


def test_completion_shape_is_raw(server, fake):
  _, c = server
  r = c.post("/v1/completions", json={"model": "fake-smol", "prompt": ["one two"], "max_tokens": 3, "stop": ["zz", "yy"]})
  assert r.status_code == 200, r.text
  b = r.json()
  assert b["id"].startswith("cmpl-") and b["object"] == "text_completion" and b["system_fingerprint"] == "fakerecipe000001"
  assert b["choices"] == [{"index": 0, "text": "one two one", "logprobs": None, "finish_reason": "length"}]
  assert fake.calls[-1]["raw"] is True and fake.calls[-1]["prompt"] == "one two" and fake.calls[-1]["stop"] == ["zz", "yy"]


def test_chat_stream_framing_and_usage(server):
  _, c = server
  whole = c.post("/v1/chat/completions", json=chat(max_tokens=6)).json()["choices"][0]["message"]["content"]
  r = c.post("/v1/chat/completions", json=chat(max_tokens=6, stream=True, stream_options={"include_usage": True}))
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
  events = sse_events(r.text)
  assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
  chunks = [json.loads(e) for e in events[:-1]]
  assert len({ch["id"] for ch in chunks}) == 1 and all(ch["object"] == "chat.completion.chunk" for ch in chunks)
  assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
  assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == whole
  assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["choices"][0]["delta"] == {}
  assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-2])
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["usage"]["total_tokens"] == 9
  assert all(ch["usage"] is None for ch in chunks[:-1])


def test_completion_stream_without_usage(server):
  _, c = server
  r = c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4, "stream": True})
  events = sse_events(r.text)
  assert events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  assert all(ch["object"] == "text_completion" and "usage" not in ch for ch in chunks)
  assert "".join(ch["choices"][0]["text"] for ch in chunks) == "a b c a" and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_official_client_against_the_fake(server):
  srv, _ = server
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
  r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x y"}], max_tokens=3)
  assert r.choices[0].message.content == "x y x" and r.usage.total_tokens == 5 and r.system_fingerprint == "fakerecipe000001"
  s = client.completions.create(model="default", prompt="p q", max_tokens=3, stream=True, stream_options={"include_usage": True})
  chunks = list(s)
  assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "p q p" and chunks[-1].usage.completion_tokens == 3


def test_n_choices_and_a_batch_of_prompts_come_back_by_index(server, fake):
  srv, c = server
  r = c.post("/v1/chat/completions", json=chat("a b", max_tokens=3, n=3)).json()
  assert [(ch["index"], ch["message"]["content"]) for ch in r["choices"]] == [(i, "a b a") for i in range(3)]
  assert r["usage"]["prompt_tokens"] == 2 and r["usage"]["completion_tokens"] == 9  # the prompt counted once
  r = c.post("/v1/completions", json={"prompt": ["x y", [7, 8, 9]], "max_tokens": 2, "n": 2}).json()
  assert [(ch["index"], ch["text"]) for ch in r["choices"]] == [(0, "x y"), (1, "x y"), (2, "t7 t8"), (3, "t7 t8")]
  assert r["usage"]["prompt_tokens"] == 2 + 3 and r["usage"]["completion_tokens"] == 8
  body = c.post("/v1/chat/completions", json=chat("p q", max_tokens=2, n=2, stream=True)).text
  events = sse_events(body)
  assert events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  texts = {i: "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"][0]["index"] == i) for i in (0, 1)}
  finish = [ch["choices"][0]["index"] for ch in chunks if ch["choices"][0]["finish_reason"]]
  assert texts == {0: "p q", 1: "p q"} and sorted(finish) == [0, 1]


def test_a_responses_request_is_a_chat_request_and_streams_openais_events(server, fake):
  srv, c = server
  r = c.post("/v1/responses", json={"model": "fake-smol", "instructions": "be brief", "input": "u v w", "max_output_tokens": 3}).json()
  assert fake.calls[-1]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "u v w"}]
  assert r["object"] == "response" and r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
  assert r["output"][0]["content"][0]["text"] == "be brief u" and r["usage"]["output_tokens"] == 3
  body = c.post("/v1/responses", json={"model": "fake-smol", "input": [{"role": "user", "content": "u v"}], "stream": True,
                                       "max_output_tokens": 4}).text
  events = sse_events(body)
  kinds = [json.loads(e)["type"] for e in events]
  assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
  assert kinds[-1] == "response.incomplete" and "[DONE]" not in events  # the stand-in always runs to max_output_tokens
  assert [json.loads(e)["sequence_number"] for e in events] == list(range(len(events)))


def test_responses_input_items_become_the_chat_turns():
  from pyruntime.serving import responses_api
  msgs, origins = responses_api.messages([
    {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
    {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}", "id": "fc_1", "status": "completed"},
    {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"a\": 1}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}]}], "sys")
  assert msgs == [{"role": "system", "content": "sys"}, {"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                    {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{\"a\": 1}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
  assert [o[0] for o in origins] == ["instructions", "input[0]", "input[1]", "input[3]", "input[4]"]
  assert origins[2][1] == ["input[1]", "input[2]"]  # the merged calls each keep their own item
  assert responses_api.own_name("messages[2].tool_calls[1].function.arguments", origins) == "input[2].arguments"
  assert responses_api.own_name("messages[3].content", origins) == "input[3].output"
  assert responses_api.own_name("messages[0].content", origins) == "instructions"


# --- hostile input: every route answers by name, never a 500 or a cut stream -------------------------------------
SURROGATE = "\ud800"


@pytest.mark.parametrize("path,body", [
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], SURROGATE: 1}),
  ("/v1/completions", {"prompt": "hi", SURROGATE: 1}),
  ("/v1/responses", {"input": "hi", SURROGATE: 1}),
  ("/tokenize", {"prompt": "hi", SURROGATE: 1}),
  ("/detokenize", {"tokens": [1], SURROGATE: 1}),
  ("/v1/responses", {"input": [{"type": SURROGATE}]}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_a_name_comes_back_escaped(shared_server, path, body, stream):
  """JSON's "\\ud800" is a lone surrogate once parsed: echoed in an error's `param` it must come back as its escape
  (one renderer for every route), not fail the answer with a 500."""
  _, _, c = shared_server
  if stream and path.startswith("/v1"): body = {**body, "stream": True}
  r = c.post(path, content=json.dumps(body))  # json.dumps escapes it: what a client sends
  assert r.status_code == 400, r.text
  assert "\\ud800" in r.text and json.loads(r.text)["error"]["param"].startswith(("\ud800", "input[0].type")), r.text


def test_lone_surrogates_in_responses_fields_are_echoed_escaped(server):
  _, c = server
  body = {"input": "a b", "instructions": f"be {SURROGATE}", "user": SURROGATE, "metadata": {"k": SURROGATE, SURROGATE: "v"},
          "max_output_tokens": 2}
  r = c.post("/v1/responses", content=json.dumps(body))
  assert r.status_code == 200 and json.loads(r.text)["metadata"] == {"k": SURROGATE, SURROGATE: "v"}, r.text
  lines = [ln for ln in c.post("/v1/responses", content=json.dumps({**body, "stream": True})).text.splitlines() if ln.startswith("data: ")]
  events = [json.loads(ln[6:]) for ln in lines]
  assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["user"] == SURROGATE, events[-1]  # max_output_tokens


@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k": {"nested": "v"}}, {"k": "v" * 513}, {"k" * 65: "v"},
                                      {"k": 1}, "text"])
def test_metadata_is_held_to_openais_rule(shared_server, metadata):
  _, _, c = shared_server
  r = c.post("/v1/responses", json={"input": "hi", "metadata": metadata, "stream": True})
  assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text


def test_metadata_nested_to_the_parsers_limit_is_a_400_streamed_or_not(shared_server):
  _, _, c = shared_server
  deep = "{\"a\":" * 900 + "1" + "}" * 900
  for stream in ("false", "true"):
    r = c.post("/v1/responses", content=f'{{"input": "hi", "stream": {stream}, "metadata": {deep}}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text


@pytest.mark.parametrize("text,param", [
  ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
  ({"format": {"type": "json_schema", "name": "x", "shema": {"type": "object"}}}, "text.format.shema"),
  ({"format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, "text.format.json_schema"),
])
def test_a_schema_format_without_its_schema_is_refused_naming_responses_fields(shared_server, text, param):
  _, _, c = shared_server
  r = c.post("/v1/responses", json={"input": "hi", "text": text})
  assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("instructions", [None, "be brief"])
def test_responses_errors_name_the_input_item(shared_server, instructions):
  """Bad call arguments named by the item that carries them, whatever instructions or merged calls did to the chat
  translation's message indices."""
  _, _, c = shared_server
  items = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
           {"type": "function_call", "call_id": "b", "name": "f", "arguments": "[1]"},
           {"type": "function_call_output", "call_id": "a", "output": "x"}]
  body = {"input": items, "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}
  if instructions: body["instructions"] = instructions
  r = c.post("/v1/responses", json=body)
  assert r.status_code == 400 and r.json()["error"]["param"] == "input[2].arguments", r.text


@pytest.mark.parametrize("top", ["", False, [], {}, 21])
def test_responses_top_logprobs_is_an_integer_or_nothing(shared_server, top):
  _, _, c = shared_server
  r = c.post("/v1/responses", json={"input": "hi", "top_logprobs": top})
  assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi", "model": 123}), ("/detokenize", {"tokens": [1], "model": []})])
def test_the_tokenizer_routes_check_model_as_chat_does(shared_server, path, body):
  _, _, c = shared_server
  r = c.post(path, json=body)
  assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_streamed_responses_logprobs_keep_tokens_that_bring_no_text():
  """A character split across tokens: the tokens before its last bring no text. Their entries still come, streamed
  as not: every token has one."""
  from pyruntime.protocol import TokenScore
  from pyruntime.serving import responses_api

  class Bytes:
    def token_bytes(self, t: int, special: bool = False) -> bytes: return {1: b"\xe2", 2: b"\x82", 3: b"\xac", 4: b"!"}[t]
  req = responses_api.parse({"input": "hi", "top_logprobs": 0, "include": ["message.output_text.logprobs"], "stream": True})
  shaper = responses_api.ResponsesShaper(req, {"input": "hi"}, "m", Bytes())
  deltas = [Delta("", [1], logprobs=[TokenScore(1, -0.1)]), Delta("", [2], logprobs=[TokenScore(2, -0.2)]),
            Delta("\u20ac", [3], logprobs=[TokenScore(3, -0.3)]), Delta("!", [4], logprobs=[TokenScore(4, -0.4)])]
  streamed = [e for d in deltas for c in shaper.delta_chunks(0, d) if c["type"] == "response.output_text.delta" for e in c["logprobs"]]
  done = Done("length", Usage(1, 4), Timings(0.1, 0.01, 50.0, 0.2), [9], [1, 2, 3, 4], "\u20ac!",
              logprobs=[TokenScore(i, -i / 10) for i in range(1, 5)])
  final = shaper.final_chunks(0, done)[-1]["response"]["output"][0]["content"][0]["logprobs"]
  assert [e["logprob"] for e in streamed] == [e["logprob"] for e in final] == [-0.1, -0.2, -0.3, -0.4]


# --- errors -----------------------------------------------------------------------------------------
LONG = "w " * 1200
ERRORS = [  # (route, body, param, code)
  ("chat", chat(LONG), "messages", "context_length_exceeded"),
  ("completions", {"prompt": LONG}, "prompt", "context_length_exceeded"),
  ("completions", {"prompt": ""}, "prompt", "invalid_value"),
  ("completions", {"prompt": "   "}, "prompt", "invalid_value"),          # empty after tokenization (the launcher says so)
  ("completions", {}, "prompt", "invalid_value"),
  ("completions", {"prompt": [1, "a"]}, "prompt", "invalid_value"),
  ("completions", {"prompt": ["a", ""]}, "prompt", "invalid_value"),
  ("completions", {"prompt": [[1, 2], []]}, "prompt", "invalid_value"),
  ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),      # 0 only with echo (scoring)
  ("chat", {"model": "m"}, "messages", "invalid_value"),
  ("chat", {"messages": []}, "messages", "invalid_value"),
  ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
  ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
  ("chat", chat(temperature="hot"), "temperature", "invalid_value"),
  ("chat", chat(temperature=-1), "temperature", "invalid_value"),
  ("chat", chat(top_p=1.5), "top_p", "invalid_value"),
  ("chat", chat(top_k=-2), "top_k", "invalid_value"),
  ("chat", chat(top_k=1.5), "top_k", "invalid_value"),
  ("chat", chat(min_p=2), "min_p", "invalid_value"),
  ("chat", chat(seed="s"), "seed", "invalid_value"),
  ("chat", chat(max_tokens=0), "max_tokens", "invalid_value"),
  ("chat", chat(max_tokens=True), "max_tokens", "invalid_value"),
  ("chat", chat(max_completion_tokens=-3), "max_completion_tokens", "invalid_value"),
  ("chat", chat(max_tokens=4, max_completion_tokens=5), "max_completion_tokens", "invalid_value"),
  ("chat", chat(frequency_penalty=3), "frequency_penalty", "invalid_value"),
  ("chat", chat(presence_penalty="x"), "presence_penalty", "invalid_value"),
  ("chat", chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
  ("chat", chat(stop=5), "stop", "invalid_value"),
  ("chat", chat(stop=["ok", 1]), "stop", "invalid_value"),
  ("chat", chat(stream="yes"), "stream", "invalid_value"),
  ("chat", chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
  ("chat", chat(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation", "unsupported_parameter"),
  ("chat", chat(model=7), "model", "invalid_value"),
  ("chat", chat(n=0), "n", "invalid_value"),
  ("chat", chat(n=129), "n", "invalid_value"),
  ("completions", {"prompt": ["a"] * 65, "n": 2}, "n", "invalid_value"),                 # 130 choices in all
  ("chat", chat(response_format={"type": "xml"}), "response_format", "invalid_value"),
  ("chat", chat(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), "response_format.json_schema.schema", "invalid_value"),
  ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema", "invalid_value"),
  ("chat", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "shema": {"type": "object"}}}),
   "response_format.json_schema.shema", "invalid_value"),
  ("chat", chat(top_logprobs=""), "top_logprobs", "invalid_value"),
  ("chat", chat(top_logprobs=False), "top_logprobs", "invalid_value"),
  ("chat", chat(top_logprobs=[]), "top_logprobs", "invalid_value"),
  ("chat", chat(top_logprobs={}), "top_logprobs", "invalid_value"),
  ("chat", chat(response_format="json"), "response_format", "invalid_value"),
  ("chat", chat(tools=[{"type": "function", "function": {"name": "f g"}}]), "tools[0].function.name", "invalid_value"),
  ("chat", chat(tool_choice="auto"), "tool_choice", "invalid_value"),
  ("chat", chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
   "tool_choice", "invalid_value"),
  ("completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter"),
  ("chat", chat(prediction={"type": "text", "content": "x"}), "prediction", "invalid_value"),
  ("chat", chat(prediction={"type": "content", "content": 3}), "prediction.content", "invalid_value"),
  ("chat", chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
  ("chat", chat(logprobs="yes"), "logprobs", "invalid_value"),
  ("chat", chat(top_logprobs=2), "top_logprobs", "invalid_value"),                      # without logprobs: true
  ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
  ("chat", chat(logit_bias={"42": 5}), "logit_bias", "unsupported_parameter"),
  ("chat", chat(frobnicate=1), "frobnicate", "unsupported_parameter"),
  ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
   "messages[0].content[0].type=image_url", "unsupported_parameter"),
  ("completions", {"prompt": "x", "best_of": 2}, "best_of", "unsupported_parameter"),
  ("completions", {"prompt": "x", "echo": 1}, "echo", "invalid_value"),
  ("completions", {"prompt": "x", "suffix": "end"}, "suffix", "unsupported_parameter"),
  ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
  ("completions", {"prompt": "x", "logprobs": True}, "logprobs", "invalid_value"),
  ("completions", {"prompt": "x", "messages": []}, "messages", "unsupported_parameter"),
  ("completions", {"prompt": "x", "max_completion_tokens": 3}, "max_completion_tokens", "unsupported_parameter"),
]


@pytest.mark.parametrize("route,body,param,code", ERRORS, ids=[f"{r}-{p}-{i}" for i, (r, _, p, _) in enumerate(ERRORS)])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_requests_are_400_naming_the_field(shared_server, route, body, param, code, stream):
  fake, _, c = shared_server
  if stream and "stream" not in body and "stream_options" not in body: body = {**body, "stream": True}
  r = c.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code, err
  assert err["message"]
  if code == "context_length_exceeded": assert "1000" in err["message"] and "1200" in err["message"]
  assert fake.started == []   # nothing ran


MINIMAL = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
           "completion": ("/v1/completions", {"prompt": "x"}), "responses": ("/v1/responses", {"input": "hi"}),
           "tokenize": ("/tokenize", {"prompt": "hi"}), "detokenize": ("/detokenize", {"tokens": [1]})}


def _table_cases() -> list[tuple[str, str, Any, str]]:
  """(route, field, a value of a JSON type the table does not give the field, the error code) for every field of every
  route in the table; a refused feature's case is a value of its own type that asks for something."""
  from pyruntime.serving.request_fields import FIELDS, Field
  cases = []
  for route, table in FIELDS.items():
    for name, f in table.items():
      f: Field
      if f.neutral is None: cases.append((route, name, next(v for v in ("x", 1.5, True, {}, []) if not _json_type_ok(f, v)), "invalid_value"))
      else: cases.append((route, name, next(v for v in ("on", 7, True, {"a": "b"}, ["x"]) if _json_type_ok(f, v) and not f.asks_nothing(v)),
                          "unsupported_parameter"))
  return cases


def _json_type_ok(f: Any, v: Any) -> bool:
  from pyruntime.serving.request_fields import _is
  return any(_is(v, t) for t in f.types)


@pytest.mark.parametrize("route,name,value,code", _table_cases(), ids=lambda x: x if isinstance(x, str) else None)
def test_every_field_of_every_route_is_checked_from_the_table(shared_server, route, name, value, code):
  """The table (pyruntime/serving/request_fields.py) is what every route checks first: a value of a type it does not
  give a field is a 400 naming the field, on every route; a refused feature asked for is a 400 naming it."""
  fake, _, c = shared_server
  path, body = MINIMAL[route]
  started = len(fake.started)
  r = c.post(path, json={**body, name: value})
  assert r.status_code == 400, (route, name, value, r.text)
  err = r.json()["error"]
  assert err["param"] == name and err["code"].startswith(code.split("_")[0]), (route, name, value, err)
  assert len(fake.started) == started  # nothing ran


def test_the_table_names_every_route_the_server_parses():
  from pyruntime.serving import request_fields
  assert set(MINIMAL) == set(request_fields.PATHS) and all(MINIMAL[r][0] == p for r, p in request_fields.PATHS.items())


def test_neutral_values_of_unsupported_features_are_accepted(server):
  _, c = server
  r = c.post("/v1/chat/completions", json=chat(max_tokens=2, n=1, response_format={"type": "text"}, logprobs=False, tools=[],
                                               tool_choice="none", logit_bias={}, user="someone", frequency_penalty=None))
  assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json_is_400(shared_server, raw):
  _, _, c = shared_server
  r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
  assert r.status_code == 400
  assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "invalid_json"


def test_unknown_route_and_method(server):
  _, c = server
  r = c.post("/v1/embeddings", json={})
  assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url" and "/v1/embeddings" in r.json()["error"]["message"]
  r = c.get("/v1/chat/completions")
  assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_official_client_raises_bad_request(server):
  srv, _ = server
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="default", messages=[{"role": "user", "content": LONG}])
  assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


# --- the queue --------------------------------------------------------------------------------------
def test_queue_full_is_429_and_order_is_kept(make_server, fake):
  srv, c = make_server(queue_size=1)
  fake.gate.clear()
  a, box_a = in_thread(c.post, "/v1/completions", json={"prompt": "first", "max_tokens": 2})
  assert fake.running.wait(10)
  b, box_b = in_thread(c.post, "/v1/completions", json={"prompt": "second", "max_tokens": 2})
  state = srv.server.config.app.state.pyruntime
  wait_for(lambda: state.scheduler_stats()["waiting"] == 1)
  r = c.post("/v1/completions", json={"prompt": "third", "max_tokens": 2})
  assert r.status_code == 429
  assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["retry-after"]
  with pytest.raises(openai.RateLimitError):
    openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(model="default", prompt="x", max_tokens=1)
  fake.gate.set()
  a.join(10); b.join(10)
  assert box_a["result"].json()["choices"][0]["text"] == "first first"
  assert box_b["result"].json()["choices"][0]["text"] == "second second"
  assert fake.started == ["first", "second"]
  assert sample(c.get("/metrics").text, "pyruntime_requests_total", route="/v1/completions", status="429") == 2


def test_the_real_launcher_has_everything_the_server_reads():
  """The stand-in must not hide a missing member again (the server once read a `max_streams` the Launcher no longer
  had, through a getattr default of 1, and admitted 1 + queue_size requests)."""
  from pyruntime.engine.launcher import Launcher
  from pyruntime.serving.state import LauncherLike
  members = set(LauncherLike.__annotations__) | {n for n in vars(LauncherLike) if not n.startswith("_")}
  assert {"max_streams", "submit", "close"} <= members
  assert [n for n in sorted(members) if not hasattr(Launcher, n)] == []
  assert Launcher("nowhere.gguf", max_streams=5).max_streams == 5  # a property of the options, before start


@pytest.mark.parametrize("queue_size", [0, 2])
def test_admission_counts_streams_against_the_launchers_capacity(make_server, fake, queue_size):
  """max_streams running + queue_size waiting, counted in streams (n choices are n streams); a request that can never
  fit is a 400 naming n, one that does not fit now a 429."""
  fake.max_streams = 3
  srv, c = make_server(queue_size=queue_size)
  fake.gate.clear()
  held = [in_thread(c.post, "/v1/completions", json={"prompt": f"w{i}", "max_tokens": 1}) for i in range(2)]
  state = srv.server.config.app.state.pyruntime
  wait_for(lambda: state.admission.in_flight == 2)
  r = c.post("/v1/completions", json={"prompt": "too many", "max_tokens": 1, "n": 3 + queue_size + 1})
  assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
  r = c.post("/v1/completions", json={"prompt": "does not fit now", "max_tokens": 1, "n": 2 + queue_size})
  assert r.status_code == 429, r.text
  more = [in_thread(c.post, "/v1/completions", json={"prompt": f"x{i}", "max_tokens": 1}) for i in range(1 + queue_size)]
  wait_for(lambda: state.admission.in_flight == 3 + queue_size)
  r = c.post("/v1/completions", json={"prompt": "one more", "max_tokens": 1})
  assert r.status_code == 429, r.text
  fake.gate.set()
  for t, box in held + more:
    t.join(10)
    assert box["result"].status_code == 200, box["result"].text
  wait_for(lambda: state.admission.in_flight == 0)


def test_fifo_order(server, fake):
  srv, c = server
  state = srv.server.config.app.state.pyruntime
  fake.gate.clear()
  threads = []
  for i, word in enumerate(["p0", "p1", "p2", "p3"]):
    threads.append(in_thread(c.post, "/v1/completions", json={"prompt": word, "max_tokens": 1}))
    if i == 0: assert fake.running.wait(10)
    else: wait_for(lambda i=i: state.scheduler_stats()["waiting"] == i)
  fake.gate.set()
  for t, _ in threads: t.join(10)
  assert [box["result"].json()["choices"][0]["text"] for _, box in threads] == ["p0", "p1", "p2", "p3"]
  assert fake.started == ["p0", "p1", "p2", "p3"]


# --- clients that go away ----------------------------------------------------------------------------
def test_disconnect_mid_stream_closes_the_generator(server, fake):
  srv, c = server
  fake.token_delay = 0.02
  with httpx.Client(base_url=srv.url, timeout=20) as own:
    with own.stream("POST", "/v1/chat/completions", json=chat("one two three", max_tokens=900, stream=True)) as r:
      assert r.status_code == 200
      lines = r.iter_lines()
      got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
      assert len(got) >= 2
    # leaving the block unread closes the connection
  assert fake.ended_event.wait(5), "the generator was not closed after the client went away"
  text, produced, finished = fake.ended[0]
  assert text == "one two three" and not finished and produced < 200
  fake.token_delay = 0.0
  r = c.post("/v1/chat/completions", json=chat("next one", max_tokens=3))   # the slot is free: the next request runs
  assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "next one next"
  wait_for(lambda: 'status="499"' in c.get("/metrics").text)
  assert sample(c.get("/metrics").text, "pyruntime_requests_cancelled_total") == 1


def test_disconnect_while_waiting_for_a_non_streamed_answer(server, fake):
  srv, c = server
  fake.token_delay = 0.02
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(srv.url + "/v1/completions", json={"prompt": "slow answer", "max_tokens": 900}, timeout=0.5)
  assert fake.ended_event.wait(5)
  assert fake.ended[0][0] == "slow answer" and not fake.ended[0][2] and fake.ended[0][1] < 200
  fake.token_delay = 0.0
  assert c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}).json()["choices"][0]["text"] == "after after"


def test_disconnect_while_queued_drops_the_job(server, fake):
  srv, c = server
  state = srv.server.config.app.state.pyruntime
  fake.gate.clear()
  a, box = in_thread(c.post, "/v1/completions", json={"prompt": "running", "max_tokens": 2})
  assert fake.running.wait(10)
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(srv.url + "/v1/completions", json={"prompt": "abandoned", "max_tokens": 2}, timeout=0.5)
  wait_for(lambda: state.scheduler_stats()["waiting"] == 0)
  fake.gate.set()
  a.join(10)
  assert box["result"].json()["choices"][0]["text"] == "running running"
  assert c.post("/v1/completions", json={"prompt": "later", "max_tokens": 1}).status_code == 200
  assert fake.started == ["running", "later"]   # the abandoned request never ran


# --- failures ----------------------------------------------------------------------------------------
def test_stage_failure_ends_the_request_and_health_reports_it(server, fake):
  _, c = server
  assert c.get("/health").status_code == 200
  assert c.get("/health").json()["stages"] == [{"stage": 0, "status": "alive", "layers": [0, 15]},
                                               {"stage": 1, "status": "alive", "layers": [15, 30]}]
  fake.fail = (2, errors.StageFailed(1, "WorkerExited", "killed by signal 9"))
  r = c.post("/v1/chat/completions", json=chat(max_tokens=5))
  assert r.status_code == 503 and r.headers["retry-after"].isdigit()  # no answer had started: it may be retried
  err = r.json()["error"]
  assert err["code"] == "service_unavailable" and "stage 1" in err["message"] and "WorkerExited" in err["message"]
  h = c.get("/health")
  assert h.status_code == 503
  assert h.json()["status"] == "unavailable" and {s["status"] for s in h.json()["stages"]} == {"dead"}
  assert h.json()["last_error"]["reason"] == "WorkerExited" and h.json()["last_error"]["stage"] == 1
  r = c.post("/v1/chat/completions", json=chat(max_tokens=5))   # the launcher closed itself: refused, not hung
  assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
  m = c.get("/metrics").text
  assert sample(m, "pyruntime_request_errors_total", code="StageFailed") == 1 and sample(m, "pyruntime_stage_up", stage="1") == 0


def test_stage_failure_mid_stream_is_an_sse_error_event(server, fake):
  srv, c = server
  fake.fail = (3, errors.StageFailed(0, "WorkerFatal", "boom"))
  r = c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 9, "stream": True})
  assert r.status_code == 200
  events = sse_events(r.text)
  assert "[DONE]" not in events
  assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "a b a"
  assert json.loads(events[-1])["error"]["code"] == "stage_failed"
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
  fake._closed, fake._alive, fake.fail = False, [True, True], (1, errors.StageFailed(0, "WorkerFatal", "boom"))
  with pytest.raises(openai.APIError, match="stage 0 failed"):
    for _ in client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], stream=True): pass


def test_an_error_in_one_request_ends_that_request_only(server, fake):
  _, c = server
  fake.fail = (1, RuntimeError("something broke"))
  r = c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 5})
  assert r.status_code == 500 and "something broke" in r.json()["error"]["message"]
  fake.fail = None
  assert c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 3}).json()["choices"][0]["text"] == "a b a"
  assert c.get("/health").status_code == 200


# --- metrics -----------------------------------------------------------------------------------------
def test_metrics(server):
  """The scrape goes through Prometheus' own text parser (conftest.scrape): counters, the request-phase histograms in
  seconds, the pipeline's gauges (stages' busy fraction and rows per step from their Heartbeats), the expert load."""
  _, c = server
  for _ in range(2): c.post("/v1/chat/completions", json=chat(max_tokens=4))
  c.post("/v1/chat/completions", json=chat(n=0))
  time.sleep(1.2)  # a second sample of the stages' Heartbeats
  m = c.get("/metrics")
  assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
  t = m.text
  assert sample(t, "pyruntime_requests_total", route="/v1/chat/completions", status="200") == 2
  assert sample(t, "pyruntime_requests_total", route="/v1/chat/completions", status="400") == 1
  assert sample(t, "pyruntime_prompt_tokens_total") == 6 and sample(t, "pyruntime_completion_tokens_total") == 8
  assert sample(t, "pyruntime_time_to_first_token_seconds_count") == 2 == sample(t, "pyruntime_time_to_first_token_seconds_bucket", le="+Inf")
  assert sample(t, "pyruntime_inter_token_latency_seconds_count") == 6  # 4 tokens each: 3 gaps each
  for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
    assert sample(t, f"pyruntime_{phase}_seconds_count") == 2, phase
  assert sample(t, "pyruntime_queue_depth") == 0 and sample(t, "pyruntime_requests_running") == 0
  assert sample(t, "pyruntime_ring_occupancy_ratio", ring="1") == 0.25 and sample(t, "pyruntime_ring_occupancy_ratio", ring="2") == 0.5
  assert sample(t, "pyruntime_stage_busy_ratio", stage="0") == pytest.approx(0.6, abs=0.05)
  assert sample(t, "pyruntime_stage_busy_ratio", stage="1") == 0 and sample(t, "pyruntime_stage_rows_per_step", stage="0") == 4
  assert sample(t, "pyruntime_expert_routed_tokens_total", stage="0", expert="2") == 5
  assert not any(name == "pyruntime_expert_routed_tokens_total" and dict(labels)["stage"] == "1" for name, labels in scrape(t))
  assert parse_expert_load(t) == {0: [3, 0, 5]}   # what `pyruntime inspect --server` reads back


def test_stats_is_one_view_with_its_history(server):
  """/stats (docs/stats.md): the latest view of the pipeline and a history sampled once a second, the numbers /metrics
  shows."""
  _, c = server
  c.post("/v1/chat/completions", json=chat(max_tokens=3))
  time.sleep(2.2)
  body = c.get("/stats").json()
  now, hist = body["now"], body["history"]
  assert body["version"] == 1 and len(hist) >= 2 and hist[-1]["t"] >= hist[0]["t"] + 1
  assert now["phase"] == "ok" and now["streams"] == {"running": 0, "waiting": 0, "max": 1} and now["rings"] == [0.0, 0.25, 0.5]
  assert [s["stage"] for s in now["stages"]] == [0, 1] and now["stages"][0]["layers"] == [0, 15]
  assert now["stages"][0]["busy"] == pytest.approx(0.6, abs=0.05) and now["stages"][0]["rows_per_step"] == 4
  assert now["totals"]["completion_tokens"] == 3 and now["totals"]["requests"] >= 1
  assert "history" not in c.get("/stats?history=0").json()


# --- /metrics: a stream that ends normally is a 200 -----------------------------------------------------
def test_finished_streams_count_as_200_not_499(server):
  srv, c = server
  for i in range(20):
    with c.stream("POST", "/v1/chat/completions", json=chat(f"w{i} x", max_tokens=3, stream=True)) as r:
      assert r.status_code == 200
      assert sse_events(r.read().decode())[-1] == "[DONE]"
  text = c.get("/metrics").text
  assert 'pyruntime_requests_total{route="/v1/chat/completions",status="200"} 20' in text, text
  assert 'status="499"' not in text and "pyruntime_requests_cancelled_total 0" in text


# --- model ids ------------------------------------------------------------------------------------------
def test_model_id_is_typeable():
  assert api.model_id("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"
  assert api.model_id("Smollm2 135M 8k Lc100K Mix1 Ep2") == "smollm2-135m-8k-lc100k-mix1-ep2"
  assert api.model_id("/m/My Model (v2).GGUF") == "my-model-v2"
  for name in ("a b", "Ünïcode näme", "  ", "x/y\\z?#", ".gguf"):
    assert re.fullmatch(r"[a-z0-9._-]+", api.model_id(name)), name


def test_models_list_a_typeable_id_and_requests_accept_it(make_server, fake):
  fake.model_name = "Smollm2 135M 8k Lc100K Mix1 Ep2"          # a GGUF display name, spaces and all
  fake.path = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  _, c = make_server()
  assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["smollm2-135m-instruct.q4_1"]
  for name in ("smollm2-135m-instruct.q4_1", "default", "Smollm2 135M 8k Lc100K Mix1 Ep2"):
    assert c.get(f"/v1/models/{name}").json()["id"] == "smollm2-135m-instruct.q4_1"
    r = c.post("/v1/chat/completions", json=chat(model=name, max_tokens=2))
    assert r.status_code == 200 and r.json()["model"] == "smollm2-135m-instruct.q4_1", r.text
  r = c.post("/v1/completions", json={"prompt": "no model named", "max_tokens": 1})   # no model at all: the served one
  assert r.status_code == 200 and r.json()["model"] == "smollm2-135m-instruct.q4_1"
  for route, body in (("/v1/chat/completions", chat(model="gpt-4o")), ("/v1/completions", {"model": "gpt-4o", "prompt": "x"})):
    r = c.post(route, json=body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert "smollm2-135m-instruct.q4_1" in r.json()["error"]["message"]
  assert c.get("/v1/models/gpt-4o").status_code == 404
  assert len(fake.calls) == 4   # the refused ones never reached the launcher


# --- malformed JSON is a 400 --------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [
  b"[" * 100_000 + b"]" * 100_000,                                 # nested deeper than the parser can go
  b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
  b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",           # beyond Python's int-string digit limit
  b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
  b'{"prompt": "x"', b"\xff\xfe", b"",
], ids=["deep-list", "deep-object", "huge-int", "nan", "infinity", "truncated", "not-utf8", "empty"])
def test_json_the_parser_cannot_take_is_400(shared_server, raw):
  _, _, c = shared_server
  for route in ("/v1/completions", "/v1/chat/completions"):
    r = c.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == "invalid_json" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("max_tokens", 10**100), ("temperature", 10**400), ("top_k", 2**63), ("seed", 2**64),
                                         ("seed", -(10**30)), ("top_p", 10**4000), ("penalty_last_n", -(10**300))])
def test_huge_integers_in_fields_are_400_naming_the_field(shared_server, field, value):
  _, _, c = shared_server
  r = c.post("/v1/completions", content=json.dumps({"prompt": "x", field: value}), headers={"content-type": "application/json"})
  assert r.status_code == 400 and r.json()["error"]["param"] == field and r.json()["error"]["code"] == "invalid_value", r.text[:300]
  assert len(r.json()["error"]["message"]) < 300


# --- the request body is bounded ----------------------------------------------------------------------
def raw_exchange(srv: BackgroundServer, data: bytes, timeout: float = 20.0) -> bytes:
  """Send `data` on a fresh connection and read until the server closes it."""
  with socket.create_connection((srv.host, srv.port), timeout=timeout) as s:
    s.sendall(data)
    out = b""
    while chunk := s.recv(65536): out += chunk
  return out


def response_json(raw: bytes) -> tuple[int, dict[str, str], Any]:
  head, _, body = raw.partition(b"\r\n\r\n")
  lines = head.decode().split("\r\n")
  headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
  return int(lines[0].split()[1]), headers, json.loads(body)


def test_a_body_over_the_limit_is_413_before_it_is_read(make_server, fake):
  srv, c = make_server()
  # a client announcing 20 MiB and sending none of it: answered at once from the Content-Length
  raw = raw_exchange(srv, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % (20 << 20))
  status, headers, body = response_json(raw)
  assert status == 413 and headers["connection"] == "close"
  assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
  assert str(4 << 20) in body["error"]["message"]
  assert c.get("/health").status_code == 200 and fake.calls == []
  assert 'route="/v1/completions",status="413"} 1' in c.get("/metrics").text


def test_a_chunked_body_is_cut_at_the_limit(fake):
  srv = BackgroundServer(create_app(fake, max_body_bytes=1000)).start()
  try:
    def chunk(b: bytes) -> bytes: return b"%x\r\n%s\r\n" % (len(b), b)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    # 1500 bytes in chunks of 100, never finished: refused once 1000 are passed
    status, headers, body = response_json(raw_exchange(srv, head + chunk(b'{"prompt": "' + b"x" * 88) + chunk(b"x" * 100) * 14))
    assert status == 413 and body["error"]["code"] == "request_too_large" and headers["connection"] == "close"
    ok = json.dumps({"prompt": "a b", "max_tokens": 2}).encode()
    ok = ok[:-1] + b" " * (1000 - len(ok)) + b"}"        # exactly at the limit: accepted
    r = httpx.post(srv.url + "/v1/completions", content=ok, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a b"
    r = httpx.post(srv.url + "/v1/completions", content=ok + b" ", headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert fake.calls == [dict(prompt="a b", messages=None, raw=True, max_tokens=2, stop=None)]
  finally: srv.stop()


def test_a_body_that_never_arrives_is_408(fake):
  srv = BackgroundServer(create_app(fake, timeout_request_body=0.3)).start()
  try:
    raw = raw_exchange(srv, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"content-length: 100\r\n\r\n{\"prompt\": ")
    status, headers, body = response_json(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout" and headers["connection"] == "close"
    assert fake.calls == []
  finally: srv.stop()


# --- connections are timed out --------------------------------------------------------------------------
def closed_by_server(s: socket.socket) -> bool:
  """True when the server closed the connection (EOF or reset); False if it is still open after 20 s."""
  s.settimeout(20)
  try:
    while s.recv(65536): pass
    return True
  except ConnectionResetError: return True
  except TimeoutError: return False


def test_half_sent_heads_and_silent_connections_are_closed(fake):
  srv = BackgroundServer(create_app(fake), timeout_request_head=0.5, timeout_keep_alive=0.5).start()
  try:
    socks = [socket.create_connection((srv.host, srv.port)) for _ in range(50)]
    for i, s in enumerate(socks):
      if i % 5: s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-half: ")   # half a head; every fifth sends nothing
    assert all(closed_by_server(s) for s in socks)
    for s in socks: s.close()
    # a head that keeps trickling in does not reset the clock
    with socket.create_connection((srv.host, srv.port)) as s:
      s.sendall(b"GET /health HTTP/1.1\r\n")
      for _ in range(10):
        try: s.sendall(b"x-a: b\r\n")
        except OSError: break
        time.sleep(0.1)
      assert closed_by_server(s)
    assert httpx.get(srv.url + "/health").status_code == 200     # the server is fine
  finally: srv.stop()


def test_idle_keep_alive_connections_are_closed_and_busy_ones_are_not(fake):
  srv = BackgroundServer(create_app(fake), timeout_request_head=0.5, timeout_keep_alive=0.5).start()
  try:
    with socket.create_connection((srv.host, srv.port)) as s:
      s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
      assert s.recv(65536).startswith(b"HTTP/1.1 200")
      assert closed_by_server(s)                                 # idle after its answer: closed
    with socket.create_connection((srv.host, srv.port)) as s:
      s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
      assert s.recv(65536).startswith(b"HTTP/1.1 200")
      s.sendall(b"GET /health HTTP/1.1\r\n")                    # half of a second request's head
      assert closed_by_server(s)
    # a generation that takes longer than both timeouts is not cut: they bound waiting for the client only
    fake.token_delay = 0.3
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "slow one", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "slow one slow one"
  finally:
    fake.token_delay = 0.0
    srv.stop()


def test_recovery_with_a_factory(fake):
  """A launcher that stops being alive is replaced by the factory's; meanwhile requests get 503 with Retry-After."""
  gate = threading.Event()
  made: list[FakeLauncherForUnitTests] = []

  def factory() -> FakeLauncherForUnitTests:
    gate.wait(10)
    made.append(FakeLauncherForUnitTests())
    return made[-1]

  app = create_app(fake, restart=factory)
  srv = BackgroundServer(app).start()
  c = httpx.Client(base_url=srv.url, timeout=20)
  try:
    fake._alive = [True, False]
    wait_for(lambda: c.get("/health").json()["status"] == "recovering")
    r = c.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert r.status_code == 503 and r.headers["retry-after"].isdigit() and r.json()["error"]["code"] == "service_unavailable"
    assert c.get("/health").status_code == 503
    gate.set()
    wait_for(lambda: c.get("/health").status_code == 200)
    assert fake._closed and app.state.pyruntime.launcher is made[0] and c.get("/health").json()["restarts"] == 1
    r = c.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello there"
  finally:
    gate.set()
    srv.stop()
    app.state.pyruntime.close()


def test_drain_ends_running_streams_with_an_error_and_done(server, fake):
  srv, c = server
  fake.gate.clear()   # the stream holds before its next token
  t, box = in_thread(c.post, "/v1/completions", json={"prompt": "a b", "max_tokens": 9, "stream": True})
  wait_for(lambda: len(srv.server.config.app.state.pyruntime.jobs) == 1)
  state = srv.server.config.app.state.pyruntime
  ended: list[int] = []
  d = threading.Thread(target=lambda: ended.append(state.drain(0.5)))
  d.start()
  wait_for(lambda: state.draining)
  r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
  assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable" and r.headers["retry-after"]
  assert c.get("/health").json()["status"] == "draining"
  d.join(10); t.join(10)
  assert ended == [1]
  events = sse_events(box["result"].text)
  assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"


# --- the page and its guard (pyruntime/serving/page.py, docs/page.md) ------------------------------------------------------------
def test_the_page_is_served_with_a_content_security_policy(server):
  _, c = server
  r = c.get("/")
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and '<script src="/page.js"' in r.text
  assert "default-src 'self'" in r.headers["content-security-policy"] and r.headers["x-content-type-options"] == "nosniff"
  assert c.get("/page.js").headers["content-type"].startswith("text/javascript") and c.get("/page.css").status_code == 200
  assert "default-src 'self'" in c.get("/v1/models").headers["content-security-policy"]  # every response carries it


def test_a_foreign_origin_is_refused_and_the_pages_own_is_not(server):
  srv, c = server
  r = c.post("/v1/chat/completions", json=chat(max_tokens=2), headers={"origin": "http://evil.example"})
  assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_refused"
  assert c.post("/v1/chat/completions", json=chat(max_tokens=2), headers={"origin": srv.url}).status_code == 200


def test_dns_rebinding_is_refused_by_host(fake):
  from pyruntime.serving.page import allowed_hosts
  assert allowed_hosts("0.0.0.0") is None and "example.org" in allowed_hosts("0.0.0.0", ["example.org"])
  srv = BackgroundServer(create_app(fake, allowed_hosts=allowed_hosts("127.0.0.1"))).start()
  try:
    with httpx.Client(base_url=srv.url, timeout=20) as c:
      r = c.get("/v1/models", headers={"host": "attacker.example"})
      assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
      assert c.get("/v1/models").status_code == 200 and c.get("/v1/models", headers={"host": "localhost:1"}).status_code == 200
  finally: srv.stop()


def test_an_api_key_guards_the_api_and_the_numbers_but_not_the_pages_shell(fake):
  srv = BackgroundServer(create_app(fake, api_key="s3cret")).start()
  try:
    with httpx.Client(base_url=srv.url, timeout=20) as c:
      for path in ("/v1/models", "/stats", "/metrics"):
        r = c.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer", path
        assert c.get(path, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert c.get(path, headers={"authorization": "Bearer s3cret"}).status_code == 200
      assert c.get("/").status_code == 200 and c.get("/health").status_code == 200
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
    assert client.chat.completions.create(model="default", messages=[{"role": "user", "content": "a b"}], max_tokens=2).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
  finally: srv.stop()


# --- the page's edges (issue #34) ------------------------------------------------------------------------------------
def test_an_upload_over_the_limit_gets_its_413_not_a_reset(fake):
  """The body is read and dropped (up to 4x the limit) before the 413: closing on unread data made the kernel reset the
  connection, and the client saw "peer closed connection" instead of the answer."""
  srv = BackgroundServer(create_app(fake, max_body_bytes=100_000)).start()
  try:
    body = b'{"prompt": "' + b"x" * 350_000 + b'"}'
    for _ in range(5):
      with socket.create_connection((srv.host, srv.port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        s.sendall(body)
        raw = b""
        while chunk := s.recv(65536): raw += chunk
      status, headers, reply = response_json(raw)
      assert status == 413 and reply["error"]["code"] == "request_too_large" and "content-security-policy" in headers
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=20)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
  finally: srv.stop()


def test_a_host_with_anything_after_the_name_but_a_port_is_refused(fake):
  from pyruntime.serving.page import allowed_hosts
  srv = BackgroundServer(create_app(fake, allowed_hosts=allowed_hosts("127.0.0.1"))).start()
  try:
    with httpx.Client(base_url=srv.url, timeout=20) as c:
      for host in ("[::1]evil.example", "[::1]:80evil", "localhost:x", "127.0.0.1:", "localhost.evil.example"):
        assert c.get("/v1/models", headers={"host": host}).status_code == 403, host
      for host in ("[::1]:8000", "[::1]", "localhost:1", "127.0.0.1"):
        assert c.get("/v1/models", headers={"host": host}).status_code == 200, host
  finally: srv.stop()


def test_a_non_ascii_api_key_can_match(fake):
  """Headers arrive as latin-1 text: the key is compared as bytes (its UTF-8), so a key like this one works."""
  srv = BackgroundServer(create_app(fake, api_key="clé-ü")).start()
  try:
    with httpx.Client(base_url=srv.url, timeout=20) as c:
      assert c.get("/v1/models", headers={"authorization": "Bearer clé-ü".encode()}).status_code == 200
      assert c.get("/v1/models", headers={"authorization": "Bearer clé-u".encode()}).status_code == 401
  finally: srv.stop()


def test_uvicorns_own_400_carries_the_security_headers(fake):
  srv = BackgroundServer(create_app(fake)).start()
  try:
    raw = raw_exchange(srv, b"NOT A REQUEST\x00\r\n\r\n")
    head = raw.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 400") and "content-security-policy: default-src 'self'" in head and "x-content-type-options: nosniff" in head
  finally: srv.stop()
