"""The Launcher's embedding API keeps its promises, through real stage processes on a tiny model: a cancelled stream's
callback gets exactly one final event (a Done, "cancelled"), running or waiting, one or many at once; whatever a
callback raises leaves the driver running; a callback may cancel and submit; a generate() iterator dropped before its
first next() frees its slot; on_event must be callable."""
from __future__ import annotations

import gc
import threading
import time

import pytest
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime.engine.launcher import Delta, Done, Launcher

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
  path = write_tiny_gguf(tmp_path_factory.mktemp("api") / "llama.gguf", **TINY_MODELS["llama_tied"])
  with Launcher(path, stages=2, max_context=256, max_streams=2) as launcher:
    yield launcher
  assert not any(launcher.alive())


class Recorder:
  """An on_event callback that keeps what it got, in order, and notes the first Delta."""
  def __init__(self) -> None:
    self.events: list = []
    self.started = threading.Event()
    self.final = threading.Event()

  def __call__(self, ev) -> None:
    self.events.append(ev)
    if isinstance(ev, Delta): self.started.set()
    if not isinstance(ev, Delta): self.final.set()

  def finals(self) -> list:
    return [ev for ev in self.events if not isinstance(ev, Delta)]


def idle(lm: Launcher, timeout: float = 30.0) -> None:
  deadline = time.monotonic() + timeout
  while (st := lm.scheduler_stats())["running"] or st["waiting"]:
    assert time.monotonic() < deadline, f"a slot stayed taken: {st}"
    time.sleep(0.01)


def endless(lm: Launcher, rec: Recorder):
  return lm.submit(PROMPT, raw=True, max_tokens=None, ignore_eos=True, on_event=rec)


@pytest.mark.parametrize("n", [1, 4])
def test_cancel_delivers_one_cancelled_done_to_running_and_waiting_streams(lm, n):
  """n streams with 2 slots: some run, the rest wait; cancelling each gives its callback exactly one final event, a
  Done with finish_reason "cancelled", after its last Delta, and nothing afterwards."""
  recs = [Recorder() for _ in range(n)]
  handles = [endless(lm, r) for r in recs]
  assert recs[0].started.wait(60)
  for h in handles: h.cancel()
  for h in handles: h.cancel()  # idempotent: still one final event
  idle(lm)
  time.sleep(0.2)  # anything late would have come by now
  for r in recs:
    finals = r.finals()
    assert len(finals) == 1 and isinstance(finals[0], Done) and finals[0].finish_reason == "cancelled", r.events[-3:]
    assert r.events[-1] is finals[0]
    assert finals[0].token_ids == [t for ev in r.events if isinstance(ev, Delta) for t in ev.token_ids]
  done = next(ev for ev in lm.generate(PROMPT, raw=True, max_tokens=3) if isinstance(ev, Done))  # the launcher still serves
  assert done.finish_reason in ("stop", "length")


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, RuntimeError])
def test_a_callback_that_raises_leaves_the_driver_running(lm, exc, caplog):
  def bad(ev) -> None: raise exc("from a callback")
  with caplog.at_level("WARNING", logger="pyruntime.launcher"):
    h = lm.submit(PROMPT, raw=True, max_tokens=4, ignore_eos=True, on_event=bad)
    done = next(ev for ev in lm.generate(PROMPT, raw=True, max_tokens=4, ignore_eos=True) if isinstance(ev, Done))
    assert len(done.token_ids) == 4
    h.cancel()
    idle(lm)
  said = [r.getMessage() for r in caplog.records if "on_event callback raised" in r.getMessage()]
  assert len(said) == 1 and exc.__name__ in said[0], said  # logged once for the stream, not once per event


def test_a_callback_may_cancel_its_own_stream_and_submit_another(lm):
  got: list = []
  second = Recorder()
  handle: list = []

  def cb(ev) -> None:
    got.append(ev)
    if isinstance(ev, Delta) and len(got) == 2:
      handle[0].cancel()
      lm.submit(PROMPT, raw=True, max_tokens=3, ignore_eos=True, on_event=second)
  handle.append(endless(lm, cb))
  assert second.final.wait(60), "the stream the callback submitted never ended"
  assert isinstance(second.finals()[0], Done) and len(second.finals()[0].token_ids) == 3
  finals = [ev for ev in got if not isinstance(ev, Delta)]
  assert len(finals) == 1 and finals[0].finish_reason == "cancelled"
  idle(lm)


def test_an_iterator_dropped_before_its_first_next_frees_its_slot(lm):
  """Its stream (a budget of ~240 tokens) is cancelled when the iterator goes, not run to its end."""
  before = lm.scheduler_stats()["tokens"]
  it = lm.generate(PROMPT, raw=True, max_tokens=None, ignore_eos=True)
  deadline = time.monotonic() + 30
  while lm.scheduler_stats()["tokens"] == before: assert time.monotonic() < deadline; time.sleep(0.001)
  del it
  gc.collect()
  idle(lm, timeout=10)
  assert lm.scheduler_stats()["tokens"] - before < 100


@pytest.mark.parametrize("bad", [None, 42, "print"])
def test_on_event_must_be_callable(lm, bad):
  with pytest.raises(TypeError, match="on_event"): lm.submit(PROMPT, on_event=bad)
  assert lm.scheduler_stats()["waiting"] == 0
