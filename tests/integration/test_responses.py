"""`POST /v1/responses` end to end: SmolLM2 on 2 stages behind the server, driven by the official `openai` client
(`responses.create`, `.stream`, `.parse`) and the OpenAI Agents SDK's Responses model with a function tool
(docs/serving.md#the-responses-api). A Responses request is the chat path in other words: the same messages give the
same tokens, bit for bit."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pydantic
import pytest

from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                          "additionalProperties": False}}


class City(pydantic.BaseModel):
  name: str = pydantic.Field(max_length=24)
  country: str = pydantic.Field(max_length=24)


@pytest.fixture(scope="module")
def live(smollm2_launcher, monkeypatch_module):
  monkeypatch_module.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
  srv = BackgroundServer(create_app(smollm2_launcher, queue_size=16)).start()
  try: yield smollm2_launcher, srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
  finally: srv.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as mp: yield mp


def test_a_response_is_the_chat_answer_to_the_same_messages(live):
  _, _, client = live
  r = client.responses.create(model="default", instructions="Answer in one sentence.", input="What is the capital of France?",
                              max_output_tokens=64, temperature=0)
  c = client.chat.completions.create(model="default", max_tokens=64, temperature=0,
                                     messages=[{"role": "system", "content": "Answer in one sentence."},
                                               {"role": "user", "content": "What is the capital of France?"}])
  assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
  assert r.output_text == c.choices[0].message.content and "Paris" in r.output_text
  assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
  assert [(i.type, i.role, i.status) for i in r.output] == [("message", "assistant", "completed")]


def test_a_cut_answer_is_incomplete_naming_the_budget(live):
  _, _, client = live
  r = client.responses.create(model="default", input="Write a long story about a dragon.", max_output_tokens=5, temperature=0)
  assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 5


def test_the_stream_is_openais_event_sequence_with_the_same_answer(live):
  _, _, client = live
  kw = {"model": "default", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}],
        "max_output_tokens": 64, "temperature": 0}
  whole = client.responses.create(**kw)
  with client.responses.stream(**kw) as stream:
    events = list(stream)
    final = stream.get_final_response()
  kinds = [e.type for e in events]
  assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
  assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
  assert [e.sequence_number for e in events] == list(range(len(events)))
  assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text == final.output_text
  assert len({e.response.id for e in events if e.type.startswith("response.") and hasattr(e, "response")}) == 1


def test_text_format_json_schema_gives_the_validated_object(live):
  _, _, client = live
  r = client.responses.parse(model="default", input="Which city is the capital of Italy?", text_format=City, max_output_tokens=96,
                             temperature=0)
  assert isinstance(r.output_parsed, City) and r.output_parsed.name


def test_a_function_call_and_its_output_sent_back(live):
  """tool_choice required: the answer is a function_call item whose arguments fit the tool's schema; sent back with the
  function's output as input items (as the client got them: ids, status), the next answer is a message."""
  _, _, client = live
  question = {"role": "user", "content": "What is the weather in Paris?"}
  first = client.responses.create(model="default", input=[question], tools=[WEATHER], tool_choice="required", max_output_tokens=64,
                                  temperature=0)
  calls = [i for i in first.output if i.type == "function_call"]
  assert calls and calls[0].name == "get_weather" and calls[0].call_id and first.status == "completed"
  args = json.loads(calls[0].arguments)
  assert set(args) == {"city"} and isinstance(args["city"], str)
  back = [question, *[i.model_dump(exclude_none=True) for i in first.output],
          {"type": "function_call_output", "call_id": calls[0].call_id, "output": "It is sunny and 24 degrees."}]
  second = client.responses.create(model="default", input=back, tools=[WEATHER], max_output_tokens=128, temperature=0)
  assert second.usage.input_tokens > first.usage.input_tokens and second.output_text
  assert [i.type for i in second.output][0] == "message"


def test_logprobs_come_with_the_text_as_on_the_chat_path(live):
  _, _, client = live
  r = client.responses.create(model="default", input="Say hello.", max_output_tokens=8, temperature=0, top_logprobs=2,
                              include=["message.output_text.logprobs"])
  c = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
                                     logprobs=True, top_logprobs=2)
  part = r.output[0].content[0]
  assert [(e.token, e.logprob) for e in part.logprobs] == [(e.token, e.logprob) for e in c.choices[0].logprobs.content]


@pytest.mark.parametrize("field,body", [
  ("store", {"store": True}), ("previous_response_id", {"previous_response_id": "resp_1"}),
  ("input[0].content[0].type=input_image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
  ("tools[0].type", {"tools": [{"type": "web_search"}]}), ("max_output_tokens", {"max_output_tokens": 0}),
  ("text.format.type", {"text": {"format": {"type": "xml"}}}), ("input", {"input": []}), ("background", {"background": True}),
  ("include[0]", {"include": ["reasoning.encrypted_content"]}),
  ("input[1].type=reasoning", {"input": [{"role": "user", "content": "hi"}, {"type": "reasoning"}]}),
])
def test_what_is_not_served_is_refused_by_name(live, field, body):
  _, srv, _ = live
  r = httpx.post(f"{srv.url}/v1/responses", json={"model": "default", "input": "hi", **body})
  assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_the_agents_sdk_runs_a_function_tool_through_the_responses_api(live):
  """The SDK's default model API: a tool call (required on the first turn; the SDK resets it after a call), the tool
  run with the arguments the SDK parsed, its output sent back as an input item, and the model's final text."""
  from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
  _, srv, _ = live
  set_tracing_disabled(True)
  seen: list[str] = []

  @function_tool
  def get_weather(city: str) -> str:
    """The weather in a city."""
    seen.append(city)
    return f"It is sunny in {city}."
  model = OpenAIResponsesModel(model="default", openai_client=openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0))
  agent = Agent(name="weather", model=model, tools=[get_weather],
                model_settings=ModelSettings(tool_choice="required", max_tokens=128, temperature=0))
  run = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
  assert seen and all(isinstance(c, str) and c for c in seen)
  assert isinstance(run.final_output, str) and run.final_output
  outputs = [i for i in run.to_input_list() if i.get("type") == "function_call_output"]
  assert outputs and outputs[0]["output"] == f"It is sunny in {seen[0]}."
