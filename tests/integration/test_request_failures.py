"""One request's failure stays that request's (issue #34): a bad `cache_salt` is refused at the door, and a fault
injected at each point of a request's life (admitted from the caller's thread or from the queue by the driver, its
first token, a later one, its close) ends that stream alone with a named error; its slot comes back, the driver
thread lives, /health returns to idle and says `ok`, and the next request is answered.

The faults are injected into the real launcher and stages (tiny model, 2 stages): a method of the driver or of the
stream raises for streams marked by their cache salt."""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx
import pytest
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.driver import Driver, StreamHandle
from pyruntime.engine.launcher import Done, Launcher
from pyruntime.engine.prefix_cache import PrefixIndex
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app

POISON = "poison"


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
  path = write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", **TINY_MODELS["llama_tied"])
  with Launcher(str(path), stages=2, max_streams=2, max_context=256) as lm: yield lm


@pytest.fixture(scope="module")
def server(launcher):
  with BackgroundServer(create_app(launcher, queue_size=16)) as srv: yield srv


def health(srv: BackgroundServer) -> dict:
  r = httpx.get(f"{srv.url}/health", timeout=10)
  return {"code": r.status_code, **r.json()}


def idle(srv: BackgroundServer, timeout: float = 30.0) -> dict:
  deadline = time.monotonic() + timeout
  while (h := health(srv))["running"] or h["queue_depth"]:
    assert time.monotonic() < deadline, f"the server never returned to idle: {h}"
    time.sleep(0.05)
  return h


def completion(srv: BackgroundServer, **body: Any) -> httpx.Response:
  data = json.dumps({"prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0, **body})  # \ud800 goes out escaped
  return httpx.post(f"{srv.url}/v1/completions", content=data, headers={"content-type": "application/json"}, timeout=60)


def answered(srv: BackgroundServer) -> None:
  r = completion(srv)
  assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_lone_surrogate_salts_are_refused_at_the_door_and_take_nothing(server, launcher):
  for kind in ("completions", "chat/completions"):
    for _ in range(8 if kind == "completions" else 2):  # more than the slots (2) and the whole queue would have held
      ask = {"prompt": "x"} if kind == "completions" else {"messages": [{"role": "user", "content": "x"}]}
      body = {"cache_salt": "\ud800", "max_tokens": 4, **ask}
      r = httpx.post(f"{server.url}/v1/{kind}", content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)
      assert r.status_code == 400, r.text
      assert r.json()["error"]["param"] == "cache_salt" and "lone surrogate" in r.json()["error"]["message"]
  h = idle(server)
  assert h["code"] == 200 and h["status"] == "ok"
  answered(server)
  # the embedding API checks the same
  with pytest.raises(errors.InvalidOption) as e: launcher.submit("x", raw=True, cache_salt="a\udfffb", on_event=lambda ev: None)
  assert e.value.field == "cache_salt"


def test_the_structured_output_vocabulary_is_built_at_start(launcher):
  """Not by the first structured request, whose thread would hold the GIL over every stream while building it."""
  assert getattr(launcher.tokenizer, "_llguidance", None) is not None


def _poisoned(st: StreamHandle) -> bool: return st.req.cache_salt == POISON


def inject(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
  """Make every poisoned stream raise RuntimeError at `where`."""
  def boom(*_: Any) -> None: raise RuntimeError(f"injected at {where}")
  if where == "admission":
    match = PrefixIndex.match
    monkeypatch.setattr(PrefixIndex, "match", lambda self, tokens, salt=None: boom() if salt == POISON else match(self, tokens, salt))
  elif where in ("first token", "third token"):
    push, nth = StreamHandle.push, 1 if where == "first token" else 3
    def failing_push(self: StreamHandle, token: int, end: bool, now: float | None = None, score: Any = None) -> bool:
      if _poisoned(self) and len(self.out) + 1 >= nth: boom()
      return push(self, token, end, now, score)
    monkeypatch.setattr(StreamHandle, "push", failing_push)
  elif where == "close":
    save = Driver._save_prefix
    monkeypatch.setattr(Driver, "_save_prefix", lambda self, st, n: boom() if _poisoned(st) and st.state == "closing" else save(self, st, n))
  else: raise AssertionError(where)


WHERE = ["admission", "first token", "third token", "close"]


def run_mixed(lm: Launcher, queued: bool) -> tuple[list[Any], list[Any]]:
  """Two innocent and three poisoned streams; with `queued`, all wait behind a long stream while the tail is stopped,
  so the driver thread admits them when slots free. Returns the final events of the innocent and poisoned ones."""
  finals: dict[int, Any] = {}
  def sink(i: int):
    def on(ev: Any) -> None:
      if isinstance(ev, (Done, BaseException)): finals[i] = ev
    return on
  tail = lm.handles[-1].proc.pid
  if queued: os.kill(tail, signal.SIGSTOP)
  try:
    salts = [None, POISON, POISON, None, POISON]
    if queued: lm.submit("hold the slots", raw=True, max_tokens=40, ignore_eos=True, on_event=sink(99))
    for i, salt in enumerate(salts):
      lm.submit("the quick brown fox", raw=True, max_tokens=6, temperature=0, cache_salt=salt, on_event=sink(i))
  finally:
    if queued: os.kill(tail, signal.SIGCONT)
  deadline = time.monotonic() + 60
  while len(finals) < len(salts) + queued:
    assert time.monotonic() < deadline, f"streams never ended: {finals}"
    time.sleep(0.02)
  return [finals[i] for i, s in enumerate(salts) if s is None], [finals[i] for i, s in enumerate(salts) if s == POISON]


@pytest.mark.parametrize("queued", [False, True], ids=["admitted-at-once", "queued"])
@pytest.mark.parametrize("where", WHERE)
def test_a_fault_ends_its_stream_alone(server, launcher, monkeypatch, where, queued):
  idle(server)
  inject(monkeypatch, where)
  innocent, poisoned = run_mixed(launcher, queued)
  assert all(isinstance(d, Done) and d.finish_reason == "length" and len(d.token_ids) == 6 for d in innocent), innocent
  if where == "close":  # the fault came after the answer: the stream still ended, and the stages were told
    assert all(isinstance(p, (Done, errors.RequestFailed)) for p in poisoned), poisoned
  else:
    assert all(isinstance(p, errors.RequestFailed) and f"injected at {where}" in str(p) for p in poisoned), poisoned
  assert launcher.driver.thread.is_alive() and launcher.serving()
  h = idle(server)
  assert h["code"] == 200 and h["status"] == "ok"
  monkeypatch.undo()
  answered(server)
  idle(server)  # its slot too comes back (on its CLOSE's echo, just after its answer)


def test_health_is_not_ok_while_the_driver_is_gone(tmp_path, monkeypatch):
  """A bug outside any one stream (here: the step's next tokens cannot be written) ends the pipeline by name, so a
  server restarts it instead of saying ok over a launcher that serves nothing."""
  path = write_tiny_gguf(tmp_path / "tiny.gguf", **TINY_MODELS["llama_tied"])
  with Launcher(str(path), stages=2, max_streams=2, max_context=256) as lm, BackgroundServer(create_app(lm)) as srv:
    assert health(srv)["status"] == "ok"
    def broken(self: Driver) -> None: raise RuntimeError("injected in the step's flush")
    monkeypatch.setattr(Driver, "_flush_next", broken)
    r = completion(srv)
    assert r.status_code == 500 and "DriverFailed" in r.text or "driver failed" in r.text, r.text
    h = health(srv)
    assert h["code"] == 503 and h["status"] != "ok" and "driver" in h["last_error"]["message"], h
    assert not lm.serving()
