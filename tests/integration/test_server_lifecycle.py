"""The server's life with the real launcher on a tiny model: it heals after a stage dies, and it drains on SIGTERM.

A stage is held with SIGSTOP where a test needs a request that is still running at a given moment (a tiny model
generates its whole budget in well under a second): the request is admitted and waits on the stopped stage.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime.engine.launcher import Launcher
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app

SPLIT = [(0, 2), (2, 5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return str(write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", **TINY_MODELS["llama_tied"]))


def children(pid: int) -> list[int]:
  out = []
  for p in os.listdir("/proc"):
    if not p.isdigit(): continue
    try:
      with open(f"/proc/{p}/stat") as f: ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError): continue
    if ppid == pid: out.append(int(p))
  return out


def stage_pids(pid: int) -> list[int]:
  pids = []
  for c in children(pid):
    try:
      with open(f"/proc/{c}/cmdline", "rb") as f: cmd = f.read()
    except OSError: continue
    if b"pyruntime.stage" in cmd: pids.append(c)
  return sorted(pids)


def segments_of(pid: int) -> list[str]:
  return glob.glob(f"/dev/shm/*-{pid}-*")


def wait_for(cond, timeout: float, what: str):
  deadline = time.monotonic() + timeout
  while True:
    if (v := cond()): return v
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def sse_stream(client: httpx.Client, url: str, body: dict, lines: list[str], opened: threading.Event) -> threading.Thread:
  """Stream a request in a thread, collecting its `data:` lines."""
  def run() -> None:
    try:
      with client.stream("POST", url, json=body) as r:
        lines.append(f"status {r.status_code}")
        opened.set()
        for line in r.iter_lines():
          if line.startswith("data: "): lines.append(line[len("data: "):])
    except httpx.HTTPError as e:
      lines.append(f"transport error {type(e).__name__}: {e}")
    finally:
      opened.set()
  t = threading.Thread(target=run, daemon=True)
  t.start()
  return t


def test_server_heals_after_a_stage_dies(tiny):
  made: list[Launcher] = []

  def make() -> Launcher:
    lm = Launcher(tiny, split=SPLIT, max_context=128, max_streams=2)
    made.append(lm)
    return lm.start()

  lm = make()   # in the main thread, like `pyruntime serve`; the restarts come from the server's supervisor thread
  app = create_app(lm, restart=make, restart_backoff_s=0.2)
  srv = BackgroundServer(app).start()
  c = httpx.Client(base_url=srv.url, timeout=120)
  try:
    assert c.get("/health").json()["status"] == "ok"
    r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text

    # a request in flight when a stage dies gets its error
    victim = lm.handles[1].proc.pid
    os.kill(victim, signal.SIGSTOP)
    lines: list[str] = []
    opened = threading.Event()
    t = sse_stream(c, "/v1/completions", {"prompt": "hello there", "max_tokens": 50, "stream": True}, lines, opened)
    wait_for(lambda: lm.scheduler_stats()["running"] == 1, 30, "the request to be admitted")
    os.kill(victim, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    assert lines[0] == "status 200" and json.loads(lines[-1])["error"]["code"] == "stage_failed", lines

    # recovering, then ok; new requests meanwhile get 503 with a Retry-After
    seen = set()
    refused = None
    def healed() -> bool:
      nonlocal refused
      h = c.get("/health")
      seen.add(h.json()["status"])
      if h.json()["status"] == "recovering" and refused is None:
        refused = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
      return h.status_code == 200 and h.json()["status"] == "ok"
    wait_for(healed, 120, "the pipeline to come back")
    assert "recovering" in seen, seen
    if refused is not None and refused.status_code != 200:   # refused while recovering (the restart may beat the request)
      assert refused.status_code == 503 and refused.headers["retry-after"].isdigit(), refused.text
      assert refused.json()["error"]["code"] == "service_unavailable"
    assert len(made) == 2 and app.state.pyruntime.launcher is made[1] and c.get("/health").json()["restarts"] == 1

    # the next request is served by the new pipeline
    r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert lm.alive() == [False, False]
  finally:
    c.close()
    srv.stop()
    app.state.pyruntime.close()
    lm.close()
  for m in made: assert all(h.proc.poll() is not None for h in m.handles)
  assert stage_pids(os.getpid()) == []
  assert segments_of(os.getpid()) == []


def test_server_gives_up_after_the_restart_attempts(tiny):
  """A factory that keeps failing: the server tries `restart_attempts` times, then reports unavailable for good."""
  attempts = []

  def broken() -> Launcher:
    attempts.append(time.monotonic())
    return Launcher(tiny + ".missing", split=SPLIT, max_context=128).start()

  lm = Launcher(tiny, split=SPLIT, max_context=128).start()
  app = create_app(lm, restart=broken, restart_attempts=3, restart_backoff_s=0.1)
  srv = BackgroundServer(app).start()
  c = httpx.Client(base_url=srv.url, timeout=60)
  try:
    os.kill(lm.handles[0].proc.pid, signal.SIGKILL)
    wait_for(lambda: c.get("/health").json()["status"] == "unavailable", 60, "the server to give up")
    assert len(attempts) == 3
    assert attempts[1] - attempts[0] >= 0.1 and attempts[2] - attempts[1] >= 0.2   # the waits double
    assert c.get("/health").json()["last_error"]["code"] == "GgufLocalPathMissing"
    r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
  finally:
    c.close()
    srv.stop()
    app.state.pyruntime.close()
    lm.close()
  assert stage_pids(os.getpid()) == [] and segments_of(os.getpid()) == []


def serve_process(tiny: str, tmp_path, grace: int) -> tuple[subprocess.Popen, int, object]:
  """`pyruntime serve` on the tiny model in a process of its own, logging to tmp_path/serve.log: (process, port, log)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
  log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
  proc = subprocess.Popen([sys.executable, "-m", "pyruntime", "serve", "--model", tiny, "--split", "0:2,2:5", "--max-context", "128",
                           "--port", str(port), "--shutdown-grace", str(grace)], stdout=log, stderr=subprocess.STDOUT)
  return proc, port, log


def wait_up(proc: subprocess.Popen, port: int, tmp_path) -> None:
  def up() -> bool:
    assert proc.poll() is None, (tmp_path / "serve.log").read_text()
    try: return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.TransportError: return False
  wait_for(up, 180, "the server to come up")


def release(pids, proc: subprocess.Popen) -> None:
  """Whatever a test stopped runs again, and a server still running is killed."""
  for pid in pids:
    try: os.kill(pid, signal.SIGCONT)
    except OSError: pass
  if proc.poll() is None: proc.kill(); proc.wait()


def test_serve_drains_on_sigterm(tiny, tmp_path):
  proc, port, log = serve_process(tiny, tmp_path, grace=3)
  base = f"http://127.0.0.1:{port}"
  c = httpx.Client(base_url=base, timeout=60)
  stages: list[int] = []
  try:
    wait_up(proc, port, tmp_path)
    assert c.get("/v1/models").json()["data"][0]["context_length"] == 128   # the command's options reached the launcher
    stages = stage_pids(proc.pid)
    assert len(stages) == 2
    os.kill(stages[1], signal.SIGSTOP)   # the stream below stays running until the server ends it
    lines: list[str] = []
    opened = threading.Event()
    t = sse_stream(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 100,
                                                "stream": True}, lines, opened)
    assert opened.wait(30) and lines[0] == "status 200", lines
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    def refused() -> httpx.Response | None:
      r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
      return r if r.status_code == 503 else None
    r = wait_for(refused, 10, "new requests to be refused while draining")
    assert r.json()["error"]["code"] == "service_unavailable" and "shutting down" in r.json()["error"]["message"]
    assert t.is_alive()                  # the running stream still runs inside the grace period
    t.join(60)
    assert not t.is_alive()
    assert time.monotonic() - t_term >= 2.5   # it got its grace period
    assert lines[-1] == "[DONE]", lines
    assert json.loads(lines[-2])["error"]["code"] == "server_shutting_down", lines
    os.kill(stages[1], signal.SIGCONT)
    assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
  finally:
    release(stages, proc)
    c.close()
    log.close()
  for pid in stages: assert gone(pid), pid
  assert segments_of(proc.pid) == [], (tmp_path / "serve.log").read_text()
  assert "draining" in (tmp_path / "serve.log").read_text()


def gone(pid: int) -> bool:
  """Not running: no such process, or a zombie waiting for its (new) parent to reap it."""
  try:
    with open(f"/proc/{pid}/stat") as f: return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except OSError: return True


def test_sigterm_while_the_server_heals_stops_it_and_leaves_nothing(tiny, tmp_path):
  """A stage dies; the new pipeline's stages are caught (stopped) while they load; SIGTERM then ends the server within
  its grace and a few seconds, with no stage process and no segment left."""
  proc, port, log = serve_process(tiny, tmp_path, grace=2)
  seen: set[int] = set()
  try:
    wait_up(proc, port, tmp_path)
    first = stage_pids(proc.pid)
    seen.update(first)
    os.kill(first[1], signal.SIGKILL)
    def restarting() -> list[int]:
      new = [p for p in stage_pids(proc.pid) if p not in first]
      for p in new: os.kill(p, signal.SIGSTOP)  # as soon as they exist: the restart cannot finish
      return new if len(new) == 2 else []
    seen.update(wait_for(restarting, 60, "the new pipeline's stages"))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert time.monotonic() - t0 < 2 + 5 + 10, time.monotonic() - t0  # the bound (grace + 5 s), and room for CI
  finally:
    release(seen, proc)
    log.close()
  deadline = time.monotonic() + 10
  while not all(gone(p) for p in seen): assert time.monotonic() < deadline, [p for p in seen if not gone(p)]; time.sleep(0.05)
  assert segments_of(proc.pid) == [], (tmp_path / "serve.log").read_text()
