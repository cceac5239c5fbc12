"""Request parameters are defined once (pyruntime/params.py): the CLI, the OpenAI parser and the launcher refuse the
same values with the same error, and the definitions match what the sampler and the docs promise."""
from __future__ import annotations

import pytest

from pyruntime import errors
from pyruntime.cli.commands import main
from pyruntime.engine.launcher import Launcher
from pyruntime.params import MAX_TOKENS, SAMPLING, SamplingParams, check_request
from pyruntime.serving import openai_api as api

BAD = [("temperature", -0.5), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5),
       ("seed", -1), ("repetition_penalty", 0.0), ("frequency_penalty", 2.5), ("frequency_penalty", -3.0),
       ("presence_penalty", 2.01), ("penalty_last_n", -2), ("max_tokens", 0), ("temperature", float("nan"))]


def test_a_bad_stop_is_refused_alike(capsys):
  with pytest.raises(errors.InvalidOption) as by_api: api.parse_request({"prompt": "x", "stop": ""}, api.COMPLETION)
  with pytest.raises(errors.InvalidOption) as by_launcher: Launcher().submit("hi", stop="", on_event=lambda ev: None)
  assert str(by_api.value) == str(by_launcher.value) and by_launcher.value.field == "stop"
  assert _cli_error("stop", "", capsys) == f"pyruntime: InvalidOption: {by_launcher.value}"


def _cli_error(field: str, value: object, capsys) -> str:
  """What `pyruntime generate` prints for the option; refused before the (missing) model is looked for."""
  rc = main(["generate", "hi", "--model", "/nowhere/model.gguf", "--" + field.replace("_", "-"), str(value)])
  err = capsys.readouterr().err.strip()
  assert rc == 2, err
  return err


@pytest.mark.parametrize("field,value", BAD)
def test_cli_openai_and_launcher_refuse_alike(field, value, capsys):
  with pytest.raises(errors.InvalidOption) as by_api: api.parse_request({"messages": [{"role": "user", "content": "hi"}], field: value}, api.CHAT)
  with pytest.raises(errors.InvalidOption) as by_launcher: Launcher().submit("hi", on_event=lambda ev: None, **{field: value})
  assert by_api.value.field == by_launcher.value.field == field
  assert str(by_api.value) == str(by_launcher.value)
  assert _cli_error(field, value, capsys) == f"pyruntime: InvalidOption: {by_launcher.value}"


@pytest.mark.parametrize("field,value", [("temperature", 2.0), ("temperature", 0), ("top_p", 1.0), ("frequency_penalty", -2.0),
                                         ("presence_penalty", 2), ("seed", 2**64 - 1), ("penalty_last_n", -1), ("min_p", 1.0)])
def test_bounds_are_inclusive_where_openai_is(field, value):
  assert api.parse_request({"prompt": "x", field: value}, api.COMPLETION).generate[field] == value
  check_request(None, {field: value})


def test_unknown_option_is_named():
  with pytest.raises(errors.UnsupportedFeature) as e: check_request(8, {"temprature": 1.0})
  assert e.value.feature == "temprature"
  with pytest.raises(errors.InvalidOption): SamplingParams.from_dict({"temprature": 1.0})   # in an OPEN record


def test_one_definition():
  assert {n: p.default for n, p in SAMPLING.items()} == SamplingParams().to_dict()
  from pyruntime.serving.request_fields import FIELDS
  for route in ("chat", "completion", "responses"):  # every route that generates takes every sampling field, by its Param
    assert all(FIELDS[route][n].param is p for n, p in SAMPLING.items())
  assert MAX_TOKENS.default == 256
  assert all(p.help for p in SAMPLING.values())
