"""The operator's view through real stage processes on a tiny model (docs/stats.md): /stats shows every stage busy
while streams run and idle after, its history grows once a second, /metrics parses and agrees, `pyruntime top --once`
prints the stages, and with PYRUNTIME_PROFILE the stages' profiles reach /stats/profile and the launcher."""
from __future__ import annotations

import contextlib
import io
import json
import threading
import time

import httpx
import pytest
from conftest import sample
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime.cli.commands import main as cli_main
from pyruntime.engine.launcher import Launcher
from pyruntime.serving.httpd import BackgroundServer
from pyruntime.serving.server import create_app


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  tiny = write_tiny_gguf(tmp_path_factory.mktemp("stats") / "tiny.gguf", **TINY_MODELS["llama_tied"])
  env = {"PYRUNTIME_PROFILE": "1", "PYRUNTIME_PROFILE_REPORT_S": "1"}
  with Launcher(tiny, stages=2, max_context=256, stage_env=env, warmup=True) as lm, BackgroundServer(create_app(lm)) as srv:
    yield lm, srv


def load(srv: BackgroundServer, seconds: float) -> None:
  """Streams that keep the pipeline busy for `seconds`."""
  end = time.monotonic() + seconds

  def client() -> None:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
      while time.monotonic() < end:
        c.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True, "prefix_cache": False})
  threads = [threading.Thread(target=client) for _ in range(3)]
  for t in threads: t.start()
  return threads


def test_stats_show_the_stages_working_then_idle(served):
  lm, srv = served
  for t in load(srv, 3.0): t.join(60)
  working = [v for v in httpx.get(srv.url + "/stats").json()["history"] if v["streams"]["running"] and v["tokens_per_s"] > 0]
  assert len(working) >= 2, "no sample saw the streams run"
  v = working[-1]
  assert v["phase"] == "ok" and [s["layers"] for s in v["stages"]] == [list(r) for r in lm.split]
  assert all(s["busy"] is not None and s["busy"] > 0 and s["rows_per_step"] > 0 for s in v["stages"]), v["stages"]
  time.sleep(2.5)
  body = httpx.get(srv.url + "/stats").json()
  idle = body["now"]
  assert idle["streams"]["running"] == 0 and all(s["busy"] < 0.2 for s in idle["stages"]), idle["stages"]
  assert len(body["history"]) >= 5 and all(b["t"] > a["t"] for a, b in zip(body["history"], body["history"][1:], strict=False))
  assert idle["totals"]["completion_tokens"] >= 40
  m = httpx.get(srv.url + "/metrics").text
  assert sample(m, "pyruntime_completion_tokens_total") == idle["totals"]["completion_tokens"]
  assert sample(m, "pyruntime_stage_busy_ratio", stage="0") is not None and sample(m, "pyruntime_inter_token_latency_seconds_count") > 0


def test_each_stages_memory_is_shown_by_kind(served):
  """/stats shows where each stage process's memory goes (pyruntime/stage/memory_use.py), as the stages report it to
  Launcher.stage_stats: the kinds add up to no more than the process's resident bytes, its weights are what it loaded,
  and the KV pages the streams wrote are resident (a CPU maps a buffer's pages as they are written)."""
  lm, srv = served
  for t in load(srv, 1.0): t.join(60)
  mem = [s["memory"] for s in lm.stage_stats()]
  for m, st in zip(mem, lm.stage_view(), strict=True):
    assert m["weights"] == st["resident_bytes"] > 0 and 0 < m["kv_resident"] <= m["kv_reserved"]
    parts = m["weights"] + m["kv_resident"] + m["other_buffers"] + m["allocator_cache"] + m["prefix_cache"] + m["rest"]
    assert parts == m["rss"] and m["rest"] > 0 and 0 < m["rss_file"] < m["rss"], m
  shown = httpx.get(srv.url + "/stats?history=0").json()["now"]["stages"]
  assert all(set(s["memory"]) == set(mem[0]) for s in shown), shown


def test_top_prints_the_pipeline(served):
  lm, srv = served
  out = io.StringIO()
  with contextlib.redirect_stdout(out): assert cli_main(["top", srv.url, "--once"]) == 0
  text = out.getvalue()
  for i, (a, b) in enumerate(lm.split): assert f"stage {i} up   layers {a}-{b}" in text, text
  assert "ring 0" in text and "tokens back" in text
  out = io.StringIO()
  with contextlib.redirect_stdout(out): cli_main(["top", srv.url, "--once", "--json"])
  assert [s["stage"] for s in json.loads(out.getvalue())["stages"]] == [0, 1]


def test_the_stages_profiles_reach_the_server(served):
  lm, srv = served
  for t in load(srv, 1.5): t.join(60)
  deadline = time.monotonic() + 10
  while len(profiles := httpx.get(srv.url + "/stats/profile").json()["profiles"]) < 2: assert time.monotonic() < deadline; time.sleep(0.2)
  assert sorted(p["stage"] for p in profiles) == [0, 1]
  assert all(p["samples"] > 0 and p["lines"] and "pyruntime" in p["lines"][0]["where"] for p in profiles), profiles
