"""Many streams at once through real stage processes, on a tiny GGUF model: every stream's tokens equal its solo run,
cancellation frees the slot in every stage, waiting streams are served first come first served, and a dead stage
ends every running stream by name."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import sample
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launcher import Delta, Done, Launcher

SPLIT = [(0, 2), (2, 5)]
PROMPTS = ["The", "The quick brown fox jumps", "Hello world! Hello there, how are you?",
           "A tiny model has tiny weights, but the tokenizer is real: it merges the most frequent pairs of bytes. Hello world!",
           "In the beginning there was the word, and the word was with the model. Stages pass the residual stream along. "
           "The dog sleeps in the sun, and the fox runs into the forest.", "42", "What is the answer?", "fox dog sun"]
SAMPLED = {1: dict(temperature=0.9, seed=7), 4: dict(temperature=1.2, top_k=20, seed=3), 6: dict(temperature=0.7, top_p=0.9, seed=11)}
N = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return write_tiny_gguf(tmp_path_factory.mktemp("m") / "llama.gguf", **TINY_MODELS["llama_tied"])


@pytest.fixture(scope="module")
def lm(tiny):
  with Launcher(tiny, split=SPLIT, max_context=128, max_streams=8) as launcher:
    yield launcher
  assert not any(launcher.alive())


def done_of(events) -> Done:
  return next(ev for ev in events if isinstance(ev, Done))


def wait_idle(lm: Launcher, timeout: float = 10.0) -> None:
  """A finished stream's Done comes before its CLOSE went round the pipeline; the slot is free after that."""
  deadline = time.monotonic() + timeout
  while (st := lm.scheduler_stats())["running"] or st["waiting"]:
    assert time.monotonic() < deadline, st
    time.sleep(0.01)


def generate(lm: Launcher, i: int, n: int = N) -> Done:
  return done_of(lm.generate(PROMPTS[i], raw=True, max_tokens=n, ignore_eos=True, **SAMPLED.get(i, {})))


def test_streams_in_flight_equal_their_solo_runs(lm):
  """8 streams of different prompt lengths (one of two prefill chunks), greedy and seeded, each started when the one
  before has two tokens out, so they join a running batch at different steps: each gives exactly its solo tokens."""
  solo = {i: generate(lm, i).token_ids for i in range(len(PROMPTS))}
  together: dict[int, list[int]] = {}
  under_way = [threading.Event() for _ in PROMPTS]  # by tokens, not by time: a fast machine runs 10 tokens in 50 ms

  def one(i: int) -> None:
    if i: under_way[i - 1].wait(60)
    tokens = 0
    for ev in lm.generate(PROMPTS[i], raw=True, max_tokens=N, ignore_eos=True, **SAMPLED.get(i, {})):
      tokens += isinstance(ev, Delta) and bool(ev.token_ids)
      if tokens >= 2: under_way[i].set()
      if isinstance(ev, Done): together[i] = ev.token_ids
    under_way[i].set()
  threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
  for t in threads: t.start()
  for t in threads: t.join(300)
  assert together == solo
  wait_idle(lm)
  stats = lm.stage_stats()
  assert max(s["max_batch"] for s in stats) > 1  # they did share steps
  # every stage collected garbage on its own loop (the model's load alone passes the threshold) and timed it
  assert all(s["gc_collections"] >= 1 and s["gc_s"] >= s["gc_max_s"] > 0 for s in stats), stats


def test_driver_cpu_is_the_driver_threads_own(lm):
  """Launcher.driver_cpu_s(): the driver thread's CPU clock, which grows while it reads tokens, and is not the process's
  (this thread's busy loop does not move it)."""
  before = lm.driver_cpu_s()
  t = time.thread_time()
  while time.thread_time() - t < 0.2: pass
  idle = lm.driver_cpu_s() - before
  generate(lm, 0, 4)
  assert 0 <= idle < 0.1 and lm.driver_cpu_s() > before + idle


def test_cancelled_stream_leaves_nothing_in_flight(lm):
  gen = lm.generate(PROMPTS[4], raw=True, max_tokens=100, ignore_eos=True)
  deltas = (ev for ev in gen if isinstance(ev, Delta))
  for _ in range(3): next(deltas)
  gen.close()  # walked away mid-stream: the launcher closes it in every stage
  wait_idle(lm)
  for s in lm.stage_stats(): assert s["open_streams"] == 0 and s["pending_tokens"] == 0, s
  assert generate(lm, 0, 3).usage.completion_tokens == 3  # and the pipeline serves on


def test_waiting_streams_are_served_in_order(lm):
  """More streams than slots: the rest wait, first come first served, and all finish with their solo tokens."""
  solo = generate(lm, 3, 4).token_ids
  order: list[int] = []
  lock = threading.Lock()
  results: dict[int, Done] = {}

  def one(i: int) -> None:
    for ev in lm.generate(PROMPTS[3], raw=True, max_tokens=4 + (i < 8) * 20, ignore_eos=True):
      if isinstance(ev, Delta) and ev.token_ids:
        with lock:
          if i not in order: order.append(i)
      if isinstance(ev, Done): results[i] = ev
  threads = []
  for i in range(11):  # 8 long ones fill the slots, then 3 short ones wait
    threads.append(threading.Thread(target=one, args=(i,)))
    threads[-1].start()
    time.sleep(0.05)
  for t in threads: t.join(300)
  assert [i for i in order if i >= 8] == [8, 9, 10]
  assert all(results[i].timings.queue_s > 0 for i in (8, 9, 10))
  assert all(results[i].token_ids == solo for i in (8, 9, 10))


def test_stage_death_ends_every_stream_by_name(tiny):
  lm = Launcher(tiny, split=SPLIT, max_context=128, max_streams=4).start()
  pids, arena = [h.proc.pid for h in lm.handles], "/dev/shm" + lm.arena.name
  try:
    caught: dict[int, BaseException] = {}
    started = threading.Barrier(4)

    def one(i: int) -> None:
      try:
        events = lm.generate(PROMPTS[i], raw=True, max_tokens=100, ignore_eos=True)
        next(events)
        started.wait(60)
        for _ in events: pass
      except BaseException as e:  # noqa: BLE001
        caught[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads: t.start()
    started.wait(120)
    t0 = time.monotonic()
    os.kill(lm.handles[1].proc.pid, signal.SIGKILL)
    for t in threads: t.join(30)
    assert time.monotonic() - t0 < 2.0
    assert set(caught) == {0, 1, 2}
    for e in caught.values(): assert isinstance(e, errors.StageFailed) and e.stage == 1 and "signal 9" in str(e), e
    assert not os.path.exists(arena)   # the failure took the segments with it, before anyone called close()
  finally:
    lm.close()
  assert not any(lm.alive())
  for pid in pids: assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def test_closing_after_a_stage_died_names_that_stage(tiny):
  """Someone else closes the launcher (a server's supervisor, say) right after a stage died, before the driver has
  seen it: the running stream still ends with StageFailed naming that stage, not with LauncherClosed."""
  lm = Launcher(tiny, split=SPLIT, max_context=128).start()
  try:
    events = lm.generate(PROMPTS[0], raw=True, max_tokens=1000, ignore_eos=True)
    next(events)
    victim = lm.handles[1].proc
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    lm.close()
    with pytest.raises(errors.StageFailed) as e:
      for _ in events: pass
    assert e.value.stage == 1 and "signal 9" in str(e.value)
  finally:
    lm.close()
  assert not any(lm.alive())


# --- the server over the real launcher ------------------------------------------------------------
def sse_token_times(client, body: dict) -> tuple[int, list[float]]:
  times = []
  with client.stream("POST", "/v1/completions", json=body) as r:
    for line in r.iter_lines():
      if line.startswith("data: {") and '"text":"' in line.replace(" ", "") and '"text":""' not in line.replace(" ", ""):
        times.append(time.monotonic())
    return r.status_code, times


def test_server_runs_requests_concurrently(lm):
  import httpx

  from pyruntime.serving.httpd import BackgroundServer
  from pyruntime.serving.server import create_app
  with BackgroundServer(create_app(lm, queue_size=4)) as srv:
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    results: dict[int, tuple[int, list[float]]] = {}

    def one(i: int) -> None:
      with httpx.Client(base_url=srv.url, timeout=300) as c:
        results[i] = sse_token_times(c, {"model": model, "prompt": PROMPTS[i], "max_tokens": 12, "stream": True, "ignore_eos": True})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads: t.start()
    for t in threads: t.join(300)
    assert all(status == 200 and times for status, times in results.values()), results
    # they ran side by side, not in turn: taken by first token, each request had its first token before an earlier one
    # had its last. (Not "all four at once": a stage takes one new prompt's chunk per step, so on a loaded machine the
    # first request's 12 tokens can all be out before the fourth prompt's chunk ran; in turn, no two would overlap.)
    spans = sorted((times[0], times[-1]) for _, times in results.values())
    assert all(first < max(last for _, last in spans[:i]) for i, (first, _) in enumerate(spans) if i), spans
    metrics = httpx.get(srv.url + "/metrics").text
    assert sample(metrics, "pyruntime_max_streams") == 8 and sample(metrics, "pyruntime_batch_size_mean") > 1


def test_server_client_gone_frees_its_stream_in_every_stage(lm):
  import httpx

  from pyruntime.serving.httpd import BackgroundServer
  from pyruntime.serving.server import create_app
  with BackgroundServer(create_app(lm)) as srv:
    with httpx.Client(base_url=srv.url, timeout=300) as c:
      body = {"model": "default", "prompt": PROMPTS[4], "max_tokens": 100, "stream": True, "ignore_eos": True}
      with c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'): pass
    # the connection is closed: the server cancels the stream, every stage frees its slot
    wait_idle(lm)
    for s in lm.stage_stats(): assert s["open_streams"] == 0, s
