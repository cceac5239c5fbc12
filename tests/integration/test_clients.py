"""The libraries people put in front of an OpenAI-compatible server, unchanged, against `pyruntime serve`'s app on
127.0.0.1 (docs/tools.md, "Clients"): LangChain (`langchain-openai`), instructor, pydantic-ai and the OpenAI Agents SDK, each
asserting what the client parsed (a call whose arguments the client validated, a validated object, a tool round trip),
on a tiny test family (random weights: only the grammar makes its answers parse, so the schemas bound their strings)
and on the bundled SmolLM2 (a tool as people write it: a plain function, strings unbounded). Offline: a guard refuses
any connection but to this machine, and the Agents SDK's tracing is off."""
from __future__ import annotations

import asyncio
import socket
from typing import Annotated, Iterator

import pydantic
import pytest
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime.engine.launcher import Launcher
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app

MAX_TOKENS = 96


class Weather(pydantic.BaseModel):
  city: str = pydantic.Field(max_length=12)
  days: int = pydantic.Field(ge=1, le=7)


def bounded_weather(city: Annotated[str, pydantic.Field(max_length=12)], days: Annotated[int, pydantic.Field(ge=1, le=7)]) -> str:
  """The weather of a city for some days."""
  return f"sunny in {city} for {days} days"


def plain_weather(city: str, days: int) -> str:
  """The weather of a city for some days."""
  return f"sunny in {city} for {days} days"


@pytest.fixture(scope="module", autouse=True)
def offline(monkeypatch_module) -> Iterator[list]:
  """Every outbound connection of this process is refused unless it goes to this machine (the server under test)."""
  refused: list = []
  stock = socket.socket.connect

  def connect(self, address):
    host = address[0] if isinstance(address, tuple) else str(address)
    if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
      refused.append(address)
      raise ConnectionRefusedError(f"test_clients is offline: {address}")
    return stock(self, address)
  monkeypatch_module.setattr(socket.socket, "connect", connect)
  monkeypatch_module.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
  monkeypatch_module.setenv("LANGSMITH_TRACING", "false")
  yield refused
  assert refused == []  # no library tried to reach an outside address


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
  with pytest.MonkeyPatch.context() as mp: yield mp


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def served(request, tmp_path_factory) -> Iterator[tuple[str, object]]:
  """(base URL, the weather tool as that model's tests write it)."""
  if request.param == "tiny":
    path = write_tiny_gguf(tmp_path_factory.mktemp("clients") / "llama.gguf", **{**TINY_MODELS["llama_tied"], "context": 2048})
    with Launcher(path, stages=2, max_context=2048) as lm, BackgroundServer(create_app(lm)) as srv:
      yield srv.url + "/v1", bounded_weather
  else:
    lm = request.getfixturevalue("smollm2_launcher")
    with BackgroundServer(create_app(lm)) as srv: yield srv.url + "/v1", plain_weather


def check_weather_args(args: dict) -> None:
  assert set(args) == {"city", "days"} and isinstance(args["city"], str) and isinstance(args["days"], int), args


# --- LangChain ------------------------------------------------------------------------------------------------------
def chat_model(base: str):
  from langchain_openai import ChatOpenAI
  return ChatOpenAI(base_url=base, api_key="x", model="default", max_tokens=MAX_TOKENS, temperature=0, max_retries=0)


@pytest.mark.parametrize("choice,parallel", [("required", None), ("required", False), ("weather", None)])
def test_langchain_bind_tools_forced_gives_validated_calls(served, choice, parallel):
  base, weather = served
  kw = {} if parallel is None else {"parallel_tool_calls": parallel}
  msg = chat_model(base).bind_tools([weather], tool_choice=choice if choice == "required" else weather.__name__, **kw).invoke("Weather in Paris?")
  assert msg.tool_calls, msg
  if parallel is None:  # calls may follow calls: the budget can cut one more after the whole ones, which still count
    assert msg.response_metadata["finish_reason"] in ("tool_calls", "length")
  else: assert len(msg.tool_calls) == 1 and msg.response_metadata["finish_reason"] == "tool_calls", msg
  for call in msg.tool_calls:
    assert call["name"] == weather.__name__
    check_weather_args(call["args"])
    weather(**call["args"])


@pytest.mark.parametrize("method,strict", [("json_schema", None), ("json_schema", True), ("function_calling", None)])
def test_langchain_with_structured_output_gives_the_model_object(served, method, strict):
  base, _ = served
  kw = {} if strict is None else {"strict": strict}
  got = chat_model(base).with_structured_output(Weather, method=method, **kw).invoke("Weather in Paris?")
  assert isinstance(got, Weather)


def test_langchain_tool_round_trip(served):
  from langchain_core.messages import HumanMessage, ToolMessage
  base, weather = served
  llm = chat_model(base)
  ask = [HumanMessage("Weather in Paris?")]
  call_msg = llm.bind_tools([weather], tool_choice="required", parallel_tool_calls=False).invoke(ask)
  (call,) = call_msg.tool_calls
  result = ToolMessage(weather(**call["args"]), tool_call_id=call["id"])
  answer = llm.bind_tools([weather]).invoke([*ask, call_msg, result])
  assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
  assert answer.content or answer.tool_calls


# --- instructor -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA"])
def test_instructor_modes_give_the_validated_model(served, mode):
  import instructor
  import openai
  base, _ = served
  client = instructor.from_openai(openai.OpenAI(base_url=base, api_key="x", max_retries=0), mode=getattr(instructor.Mode, mode))
  got = client.chat.completions.create(model="default", response_model=Weather, max_retries=0, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": "Weather in Paris?"}])
  assert isinstance(got, Weather)


# --- pydantic-ai ----------------------------------------------------------------------------------------------------
def agent_model(base: str):
  from pydantic_ai.models.openai import OpenAIChatModel
  from pydantic_ai.providers.openai import OpenAIProvider
  return OpenAIChatModel("default", provider=OpenAIProvider(base_url=base, api_key="x"))


@pytest.mark.parametrize("output", ["tool", "native"])
def test_pydantic_ai_output_is_the_validated_model(served, output):
  from pydantic_ai import Agent, NativeOutput, ToolOutput
  from pydantic_ai.settings import ModelSettings
  base, _ = served
  agent = Agent(agent_model(base), output_type=ToolOutput(Weather) if output == "tool" else NativeOutput(Weather),
                model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0))
  assert isinstance(agent.run_sync("Weather in Paris?").output, Weather)


def test_pydantic_ai_calls_a_function_tool_and_sends_its_result_back(served):
  """The function is forced by name (tool_choice through pydantic-ai's extra_body; otherwise a weak model may answer with
  the output's tool at once and call nothing). Each call of the function ran with arguments pydantic-ai validated and
  its result went back in the next request; the run ends at the request limit (two: forced on every turn, the model
  keeps calling it, and the shared SmolLM2 pipeline has 512 positions)."""
  from pydantic_ai import Agent, capture_run_messages
  from pydantic_ai.exceptions import UsageLimitExceeded
  from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart
  from pydantic_ai.settings import ModelSettings
  from pydantic_ai.usage import UsageLimits
  base, weather = served
  calls: list[dict] = []
  forced = {"tool_choice": {"type": "function", "function": {"name": "weather"}}}
  agent = Agent(agent_model(base), output_type=Weather, model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0, extra_body=forced))

  @agent.tool_plain(name="weather")
  def _(city: Annotated[str, pydantic.Field(max_length=12)], days: Annotated[int, pydantic.Field(ge=1, le=7)]) -> str:
    """The weather of a city for some days."""
    calls.append({"city": city, "days": days})
    return weather(city, days)
  with capture_run_messages() as messages:
    try: assert isinstance(agent.run_sync("Weather in Paris?", usage_limits=UsageLimits(request_limit=2)).output, Weather)
    except UsageLimitExceeded: assert calls
  asked = [p for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart) and p.tool_name == "weather"]
  returned = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart) and p.tool_name == "weather"]
  assert calls and returned and len(asked) == len(calls), (calls, returned)  # called, and its result sent back
  for c in calls: check_weather_args(c)
  assert [r.content for r in returned] == [weather(**c) for c in calls[:len(returned)]]


# --- the OpenAI Agents SDK ------------------------------------------------------------------------------------------
def sdk_model(base: str):
  import openai
  from agents import OpenAIChatCompletionsModel, set_tracing_disabled
  set_tracing_disabled(True)
  return OpenAIChatCompletionsModel(model="default", openai_client=openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0))


def test_agents_sdk_function_tool_round_trip(served):
  """tool_choice required for the first turn (the SDK resets it after a call, so the next turn may answer): the tool
  runs with the arguments the SDK parsed, its result goes back, and the run ends with the model's text."""
  from agents import Agent, ModelSettings, Runner, function_tool
  base, weather = served
  calls: list[tuple] = []

  @function_tool(name_override="weather")
  def tool(city: Annotated[str, pydantic.Field(max_length=12)], days: Annotated[int, pydantic.Field(ge=1, le=7)]) -> str:
    """The weather of a city for some days."""
    calls.append((city, days))
    return weather(city, days)
  agent = Agent(name="forecaster", model=sdk_model(base), tools=[tool],
                model_settings=ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0))
  run = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=4))
  assert calls and all(isinstance(c, str) and isinstance(d, int) for c, d in calls)
  assert isinstance(run.final_output, str)


def test_agents_sdk_output_type_is_the_validated_model(served):
  from agents import Agent, ModelSettings, Runner
  base, _ = served
  agent = Agent(name="forecaster", model=sdk_model(base), output_type=Weather, model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0))
  assert isinstance(asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=2)).final_output, Weather)
