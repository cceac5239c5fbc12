"""A pipeline over two Ray nodes on this machine (ray.cluster_utils.Cluster; docs/hosts.md): the same tokens as on one
host with records crossing the bridges, a lost host or stage named within 5 s, a new pipeline after it, and nothing
left behind. Plus what needs no cluster: Ray refused by name without the extra, hosts planned and checked."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
from conftest import _alive, leaked_segments, require, run_together
from tinymodels import write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.hosts import RayPlacement, host_ranges, link_name
from pyruntime.engine.launcher import Done, Launcher
from pyruntime.protocol import ABI_VERSION

ray = require("ray", "the ray extra")
pytestmark = pytest.mark.integration


def test_without_ray_the_option_is_refused_naming_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as it does where the extra is not installed
  with pytest.raises(errors.ExtraMissing, match=r"pip install 'pyruntime\[ray\]'"): Launcher(placement="ray")
  with pytest.raises(errors.InvalidOption, match="placement"): Launcher(placement="kubernetes")
  with pytest.raises(errors.InvalidOption, match="need placement='ray'"): Launcher(hosts=2)


def test_host_ranges_are_contiguous_and_even():
  assert host_ranges(5, 2) == [(0, 2), (2, 5)] and host_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
  with pytest.raises(errors.InvalidOption, match="hosts"): host_ranges(2, 3)
  assert link_name(0, 2) == "ring 0 (the launcher to stage 0)" and link_name(2, 2) == "ring 2 (stage 1 to the launcher)"


def test_a_host_with_another_version_or_model_is_refused_by_name():
  p = RayPlacement.__new__(RayPlacement)  # only its check, on hellos as agents send them
  ok = {"host": 1, "node": "n" * 40, "ip": "10.0.0.2", "version": "0.1.0", "abi": ABI_VERSION, "model": "abc", "model_path": "/m.gguf"}
  p.hosts = [ok | {"host": 0}, ok | {"model": "xyz", "model_path": "/other.gguf"}]
  from pyruntime.engine import hosts
  with pytest.raises(errors.HostMismatch, match=r"host 1 .*10\.0\.0\.2.* model 'xyz', the launcher 'abc' \(its file: /other.gguf\)"):
    hosts.package_version, old = (lambda: "0.1.0"), hosts.package_version
    try: p._check_hosts("abc")
    finally: hosts.package_version = old


# --- on a two-node cluster ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
  from ray.cluster_utils import Cluster
  term = signal.getsignal(signal.SIGTERM)  # ray.init installs its own and leaves it: this worker runs other files next
  # no dashboard: its processes would take CPU from the stages (and from the other test worker) on these 2 cores
  c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False})
  c.add_node(num_cpus=1, object_store_memory=80 << 20)
  ray.init(address=c.address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
  c.wait_for_nodes()
  yield c
  ray.shutdown()
  c.shutdown()
  signal.signal(signal.SIGTERM, term)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return str(write_tiny_gguf(tmp_path_factory.mktemp("hosts") / "tiny.gguf"))


PROMPTS = [("The quick brown fox", {"temperature": 0.0}), ("the dog", {"temperature": 0.9, "seed": 7}),
           ("A lazy sun", {"temperature": 0.7, "top_k": 20, "seed": 3})]


def run_streams(lm: Launcher) -> list[list[int]]:
  """Every prompt as its own stream, all at once."""
  def one(i: int) -> list[int]:
    p, kw = PROMPTS[i]
    return next(ev for ev in lm.generate(p, raw=True, max_tokens=10, **kw) if isinstance(ev, Done)).token_ids
  out = run_together(one, len(PROMPTS))
  return [out[i] for i in range(len(PROMPTS))]


def remote_pids(lm: Launcher) -> list[int]:
  return [h.proc.pid for h in lm.handles] + [h["pid"] for h in lm.placement.hosts]


def gone(pids: list[int], timeout: float = 15.0) -> bool:
  deadline = time.monotonic() + timeout
  while any(map(_alive, pids)) and time.monotonic() < deadline: time.sleep(0.1)
  return not any(map(_alive, pids))


def test_two_hosts_give_the_single_host_tokens_through_the_bridges(cluster, model):
  with Launcher(model, stages=2) as lm: want = run_streams(lm)
  with Launcher(model, stages=2, placement="ray", hosts=2) as lm:
    nodes = [h.host["node"] for h in lm.handles]
    assert len(set(nodes)) == 2, "the stages must run on different nodes"
    assert run_streams(lm) == want
    crossed = lm.placement.bridge_stats()
    pids = remote_pids(lm)
  # records crossed every bridge: launcher → host 0 → host 1 → launcher
  assert crossed[0]["records"] > 0 and crossed[1]["records"] > 0
  assert crossed[2]["out"]["records"] > 0 and crossed[3]["in"]["records"] > 0  # (a stream's CLOSE may still be on its way)
  assert crossed[3]["in"]["bytes"] > crossed[0]["bytes"]  # residual rows, not token ids, cross between the hosts
  assert gone(pids), "agents or stages outlived close()"
  assert not leaked_segments()


@pytest.mark.parametrize("victim", ["agent", "frozen-agent", "stage"])
def test_a_lost_host_or_stage_is_named_within_5_s_and_nothing_is_left(cluster, model, victim):
  lm = Launcher(model, stages=2, placement="ray", hosts=2).start()
  try:
    pids = remote_pids(lm)
    s = lm.generate("The quick brown fox", raw=True, max_tokens=200, ignore_eos=True)
    next(s)  # it runs
    pid = lm.handles[1].proc.pid if victim == "stage" else lm.placement.hosts[1]["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP if victim == "frozen-agent" else signal.SIGKILL)  # frozen: a hung host, no reset
    with pytest.raises(errors.StageFailed) as e:
      for _ in s: pass
    took = time.monotonic() - t0
  finally:
    lm.close()
  assert took < 5.0, f"the loss took {took:.1f} s to reach the stream"
  assert e.value.stage == 1 and "host 1" in str(e.value), e.value
  if victim != "stage": assert isinstance(e.value, errors.HostLost) and e.value.host == 1
  assert gone(pids), "agents or stages outlived the failure"
  assert not leaked_segments()


def test_the_server_heals_once_the_cluster_can_place_the_pipeline_again(cluster, model):
  import httpx

  from pyruntime.serving.httpd import BackgroundServer
  from pyruntime.serving.server import create_app
  made: list[Launcher] = []
  def make() -> Launcher:
    made.append(Launcher(model, stages=2, placement="ray", hosts=2))
    return made[-1].start()
  app = create_app(make(), restart=make, restart_backoff_s=0.2)
  srv = BackgroundServer(app).start()
  c = httpx.Client(base_url=srv.url, timeout=120)
  try:
    assert c.post("/v1/completions", json={"prompt": "the dog", "max_tokens": 3}).status_code == 200
    os.kill(made[0].placement.hosts[1]["pid"], signal.SIGKILL)
    seen = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
      h = c.get("/health")
      seen.add(h.json()["status"])
      if h.status_code == 503: assert h.headers["retry-after"].isdigit()
      if h.json()["status"] == "ok" and len(made) == 2: break
      time.sleep(0.1)
    assert "recovering" in seen and len(made) == 2 and c.get("/health").json()["status"] == "ok", seen
    r = c.post("/v1/completions", json={"prompt": "the dog", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
  finally:
    c.close()
    srv.stop()
    app.state.pyruntime.close()
  assert gone([p for m in made for p in remote_pids(m)])
  assert not leaked_segments()


def test_a_cluster_too_small_for_the_hosts_is_refused_by_name(cluster, model, monkeypatch):
  from pyruntime.engine import hosts
  monkeypatch.setattr(hosts, "PLACE_TIMEOUT_S", 2.0)
  with pytest.raises(errors.PlacementUnavailable, match="3 hosts on 3 different nodes"):
    Launcher(model, stages=3, placement="ray", hosts=3).start()
  assert not leaked_segments()
  assert ray.util.placement_group_table() and all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_closed_launcher_leaves_no_agent_when_closed_from_another_thread_while_starting(cluster, model):
  lm = Launcher(model, stages=2, placement="ray", hosts=2)
  err: list[BaseException] = []
  t = threading.Thread(target=lambda: _start(lm, err))
  t.start()
  time.sleep(1.0)
  lm.close()
  t.join(60)
  assert not t.is_alive() and err and isinstance(err[0], errors.PyruntimeError)
  assert not leaked_segments()


def _start(lm: Launcher, err: list) -> None:
  try: lm.start()
  except BaseException as e: err.append(e)  # noqa: BLE001 - the test looks at it
