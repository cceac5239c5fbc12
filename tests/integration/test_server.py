"""End to end: `pyruntime serve`'s app on 127.0.0.1 with the real SmolLM2-135M on 2 stages, driven
by the official `openai` client, unchanged (docs/serving.md)."""
from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest
from conftest import SMOLLM2_CONTEXT as MAX_CONTEXT  # the shared launcher's (tests/conftest.py)
from conftest import sample

from pyruntime.engine.launcher import Done, Launcher
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.openai_api import model_id
from pyruntime.serving.server import create_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(smollm2_launcher):
  srv = BackgroundServer(create_app(smollm2_launcher, queue_size=16)).start()
  try: yield smollm2_launcher, srv
  finally: srv.stop()


def client_for(srv: BackgroundServer) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, str, Any]:
  if not stream:
    r = client.chat.completions.create(**kw)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
  parts, finish, usage = [], None, None
  for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
    if ch.choices:
      parts.append(ch.choices[0].delta.content or "")
      finish = ch.choices[0].finish_reason or finish
    if ch.usage is not None: usage = ch.usage
  return "".join(parts), finish, usage


def complete(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, str, Any]:
  if not stream:
    r = client.completions.create(**kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage
  parts, finish, usage = [], None, None
  for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
    if ch.choices:
      parts.append(ch.choices[0].text)
      finish = ch.choices[0].finish_reason or finish
    if ch.usage is not None: usage = ch.usage
  return "".join(parts), finish, usage


def direct(lm: Launcher, **kw: Any) -> Done:
  return next(ev for ev in lm.generate(**kw) if isinstance(ev, Done))


def test_models_and_health(live):
  lm, srv = live
  assert [m.id for m in client_for(srv).models.list()] == [model_id(lm.path)] == ["smollm2-135m-instruct.q4_1"]
  h = httpx.get(f"{srv.url}/health")
  assert h.status_code == 200 and [s["status"] for s in h.json()["stages"]] == ["alive", "alive"]


# A short system message: SmolLM2's template would otherwise add its 30-token default one (prefill is ~0.1 s a token here).
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1234, "top_p": 0.95}], ids=["greedy", "seeded"])
def test_chat_streamed_equals_non_streamed(live, sampling):
  lm, srv = live
  c = client_for(srv)
  text, finish, usage = chat(c, False, model=model_id(lm.path), messages=MESSAGES, max_tokens=8, **sampling)
  s_text, s_finish, s_usage = chat(c, True, model=lm.model_name, messages=MESSAGES, max_tokens=8, **sampling)   # the display name works too
  assert text and s_text == text and s_finish == finish
  assert (s_usage.prompt_tokens, s_usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
  assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens and 0 < usage.completion_tokens <= 8
  if sampling["temperature"] == 0:   # the server passes the request through unchanged (the completion test checks a seeded one)
    ref = direct(lm, messages=MESSAGES, max_tokens=8, **sampling)
    assert ref.text == text and ref.finish_reason == finish and ref.usage.prompt_tokens == usage.prompt_tokens


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_completion_streamed_equals_non_streamed(live, sampling):
  lm, srv = live
  c = client_for(srv)
  r = c.completions.create(model="default", prompt="Once upon a time", max_tokens=10, **sampling)
  assert r.system_fingerprint == lm.recipe and r.model == model_id(lm.path)
  text = r.choices[0].text
  s_text, s_finish, s_usage = complete(c, True, model="default", prompt="Once upon a time", max_tokens=10, **sampling)
  assert text and s_text == text and s_finish == r.choices[0].finish_reason and s_usage.completion_tokens == r.usage.completion_tokens
  assert direct(lm, prompt="Once upon a time", raw=True, max_tokens=10, **sampling).text == text


def test_errors_through_the_client(live):
  lm, srv = live
  c = client_for(srv)
  with pytest.raises(openai.BadRequestError) as e:
    c.chat.completions.create(model="default", messages=[{"role": "user", "content": "hello " * 700}])
  assert e.value.code == "context_length_exceeded" and str(MAX_CONTEXT) in e.value.message
  n = int(e.value.message.split("your prompt has ")[1].split()[0])
  assert n > MAX_CONTEXT
  with pytest.raises(openai.BadRequestError) as e:
    c.chat.completions.create(model="default", messages=MESSAGES, temperature=-1)
  assert e.value.param == "temperature"
  with pytest.raises(openai.BadRequestError) as e:
    c.chat.completions.create(model="default", messages=[{"role": "wizard", "content": "hi"}])
  assert e.value.param == "messages[0].role"
  with pytest.raises(openai.BadRequestError) as e:
    c.chat.completions.create(model="default", messages=MESSAGES, n=200)
  assert e.value.param == "n"
  with pytest.raises(openai.BadRequestError) as e:
    c.chat.completions.create(model="default", messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {"schema": []}})
  assert e.value.param == "response_format.json_schema.schema"
  with pytest.raises(openai.BadRequestError) as e:
    c.completions.create(model="default", prompt="x", logprobs=21)
  assert e.value.param == "logprobs"
  with pytest.raises(openai.BadRequestError) as e:
    c.completions.create(model="default", prompt="")
  assert e.value.param == "prompt"


def metric(srv: BackgroundServer, name: str) -> float:
  if (v := sample(httpx.get(f"{srv.url}/metrics").text, name)) is None: raise AssertionError(f"{name} not in /metrics")
  return v


def test_client_disconnect_mid_stream_frees_the_slot(live):
  lm, srv = live
  c = client_for(srv)
  cancelled = metric(srv, "pyruntime_requests_cancelled_total")
  stream = c.chat.completions.create(model="default", messages=[MESSAGES[0], {"role": "user", "content": "Write a story."}],
                                     max_tokens=400, temperature=0.0, stream=True)
  got = []
  for ch in stream:
    if ch.choices and ch.choices[0].delta.content: got.append(ch.choices[0].delta.content)
    if len(got) >= 2: break
  stream.close()   # the client goes away with ~398 tokens to go (about a minute of decoding here)
  t0 = time.monotonic()
  text, finish, _ = complete(c, False, model="default", prompt="The capital of France is", max_tokens=4, temperature=0.0)
  assert text and finish in ("length", "stop") and time.monotonic() - t0 < 30
  assert metric(srv, "pyruntime_requests_cancelled_total") == cancelled + 1


PROMPTS = ["The capital of France is", "My favourite fruit is", "Once upon a time there was", "In the year 3000,", "The ocean is"]


def test_load_three_clients_four_requests_each(live):
  lm, srv = live
  ref_client = client_for(srv)
  opts = dict(model="default", max_tokens=5, temperature=0.7)   # short: 17 generations at a few tokens/s
  refs = [complete(ref_client, False, prompt=p, seed=100 + i, **opts)[0] for i, p in enumerate(PROMPTS)]   # single-client results
  assert len(set(refs)) == len(PROMPTS), refs   # distinct, so that a mixed-up answer would show
  results: list[tuple[int, int, str]] = []
  failures: list[BaseException] = []
  lock = threading.Lock()

  def run(k: int) -> None:
    c = client_for(srv)
    for j in range(4):
      i = (j + 2 * k) % len(PROMPTS)   # the clients out of step, every prompt asked by two of them
      try: text = complete(c, (j + k) % 2 == 1, prompt=PROMPTS[i], seed=100 + i, **opts)[0]
      except BaseException as e:  # noqa: BLE001
        with lock: failures.append(e)
        continue
      with lock: results.append((k, i, text))

  threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
  for t in threads: t.start()
  for t in threads: t.join(300)
  assert not failures, failures
  assert len(results) == 12
  for k, i, text in results: assert text == refs[i], (k, i, text, refs[i])
  assert metric(srv, "pyruntime_queue_depth") == 0


def test_a_repeated_prompt_reports_cached_tokens_and_metrics_count_them(live):
  """The same long prompt twice: the second answer is the first's, `usage.prompt_tokens_details.cached_tokens` says how
  much of its prompt came from the prefix cache, and /metrics counts the hit; `prefix_cache: false` opts out."""
  lm, srv = live
  c = client_for(srv)
  messages = [{"role": "system", "content": "You answer questions about European capitals in one short sentence. " * 4},
              {"role": "user", "content": "What is the capital of Italy?"}]
  first = c.chat.completions.create(model=lm.model_name, messages=messages, max_tokens=6, extra_body={"cache_salt": "metrics-test"})
  second = c.chat.completions.create(model=lm.model_name, messages=messages, max_tokens=6, extra_body={"cache_salt": "metrics-test"})
  assert second.choices[0].message.content == first.choices[0].message.content
  assert first.usage.prompt_tokens_details.cached_tokens == 0
  assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
  off = c.chat.completions.create(model=lm.model_name, messages=messages, max_tokens=6,
                                  extra_body={"cache_salt": "metrics-test", "prefix_cache": False})
  assert off.usage.prompt_tokens_details.cached_tokens == 0 and off.choices[0].message.content == first.choices[0].message.content
  metrics = httpx.get(f"{srv.url}/metrics").text
  assert sample(metrics, "pyruntime_prefix_cache_hits_total") >= 1 and sample(metrics, "pyruntime_prefix_cache_bytes") is not None
  assert sample(metrics, "pyruntime_prefix_cache_states") == 0  # a dense model keeps no recurrent-state snapshots
  with pytest.raises(openai.BadRequestError):
    c.chat.completions.create(model=lm.model_name, messages=messages, max_tokens=1, extra_body={"cache_salt": 7})


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": {
  "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"], "additionalProperties": False}}}


def test_a_tool_round_trip_on_the_bundled_model(live):
  """SmolLM2's template knows no tools: the Hermes fallback (docs/tools.md). The call is whole and valid, streamed equals
  not streamed, and the result goes back for an answer."""
  import json
  lm, srv = live
  c = client_for(srv)
  msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
  kw = {"model": "default", "messages": msgs, "tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 60}
  r = c.chat.completions.create(**kw)
  msg = r.choices[0].message
  assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
  call = msg.tool_calls[0]
  assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
  chunks = [tc for ch in c.chat.completions.create(stream=True, **kw) if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
  assert [(t.index, t.function.name, t.function.arguments) for t in chunks] == [(0, "get_weather", call.function.arguments)]
  follow = [*msgs, msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'}]
  r2 = c.chat.completions.create(model="default", messages=follow, tools=[WEATHER_TOOL], max_tokens=30)
  assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls") and r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_the_page_chats_and_stops_on_the_real_model(live, browser):
  """The page (docs/page.md) in headless Chromium: a message streams its answer; Stop ends it mid-answer and the server's
  running count returns to 0; the stage boxes' figures change while the stream runs."""
  from conftest import wait_for
  from selenium.webdriver.common.by import By
  lm, srv = live
  drv = browser
  drv.get(srv.url + "/")
  boxes = wait_for(lambda: drv.find_elements(By.CSS_SELECTOR, "#stages .stage"), what="the stage boxes")
  assert len(boxes) == 2
  idle = wait_for(lambda: [b.text for b in drv.find_elements(By.CSS_SELECTOR, "#stages .stage")], what="the figures")
  for name, value in (("max-tokens", "300"), ("temperature", "0")):
    field = drv.find_element(By.ID, name); field.clear(); field.send_keys(value)
  drv.find_element(By.ID, "input").send_keys("Write a long story about a dragon who learns to cook.")
  drv.find_element(By.ID, "send").click()
  wait_for(lambda: len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")[-1].text) > 20, what="the answer to stream")
  wait_for(lambda: [b.text for b in drv.find_elements(By.CSS_SELECTOR, "#stages .stage")] != idle, what="the stage figures to change")
  drv.find_element(By.ID, "stop").click()
  meta = wait_for(lambda: drv.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")[-1].text.startswith("stopped") and
                  drv.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")[-1].text, what="the answer to say stopped")
  assert "stopped" in meta
  wait_for(lambda: httpx.get(srv.url + "/stats?history=0").json()["now"]["streams"]["running"] == 0, what="no stream running")
  assert len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")[-1].text) > 20  # what came before Stop stays
