"""A pipeline over several hosts, placed and watched by Ray (docs/hosts.md).

A host is a Ray node. On each, one `HostAgent` actor (host_agent.py) spawns that host's stages with the machinery a single host uses
(stage_pool.spawn_stage, an arena of rings) and relays their control channels; between hosts, and between the
launcher and the first and last host, bridges (pyruntime/transport/bridge.py) carry the rings' MO01 records over TCP. The
launcher sees each remote stage as a `StageHandle` whose process is a `RemoteProcess`, so starting, watching, the stall
rule and stopping are the single host's code. Ray is needed only here, imported only when `placement="ray"`.

Losses are found on the data path, not by Ray's node health checks (tens of seconds): a bridge hears from its peer at
least every bridge.HEARTBEAT_S and gives up after bridge.LOST_S; an agent that does not answer its poll within
AGENT_LOST_S, or dies, loses its host. Either fails the pipeline with a HostLost naming host and stage.
"""

from __future__ import annotations

import io
import logging
import secrets
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Sequence

from pyruntime import errors
from pyruntime.engine.host_agent import AGENT_LOST_S, HostAgent, link_name, package_version, sweep_segments
from pyruntime.engine.stage_pool import AFTERMATH, StageHandle
from pyruntime.protocol import ABI_VERSION, Event
from pyruntime.transport.bridge import BridgeReceiver, BridgeSender, link_hello

log = logging.getLogger("pyruntime.hosts")

AGENT_POLL_S = 0.05     # how often the launcher asks each agent for its stages' events
PLACE_TIMEOUT_S = 30.0  # how long to wait for the cluster to place every host
EXTRA = "pip install 'pyruntime[ray]'"


def require_ray() -> Any:
  try:
    import ray
  except ImportError:
    raise errors.ExtraMissing(f"placement='ray' needs Ray, an optional extra: {EXTRA}") from None
  return ray


def host_ranges(n_stages: int, hosts: int) -> list[tuple[int, int]]:
  """Stages [start, end) per host: contiguous, as even as possible (the split already balances the stages' time)."""
  if not isinstance(hosts, int) or isinstance(hosts, bool) or not 1 <= hosts <= n_stages:
    raise errors.InvalidOption("hosts", f"must be an integer from 1 to the number of stages ({n_stages}), got {hosts!r}")
  return [(k * n_stages // hosts, (k + 1) * n_stages // hosts) for k in range(hosts)]


class RemoteProcess:
  """A stage process on another host, as much of subprocess.Popen as the launcher uses: its agent does the work."""

  def __init__(self, agent: Any, index: int, pid: int):
    self.agent, self.index, self.pid = agent, index, pid
    self.returncode: int | None = None
    self.exited = threading.Event()
    self.stdin = _RemoteStdin(self)

  def poll(self) -> int | None: return self.returncode

  def ended(self, rc: int) -> None:
    if self.returncode is None: self.returncode = rc
    self.exited.set()

  def wait(self, timeout: float | None = None) -> int:
    """Its exit code, once its agent reported the exit. Without a timeout, a host that never reports again counts as
    gone after AGENT_LOST_S (its watcher says so sooner), so a shutdown cannot hang on it."""
    if not self.exited.wait(AGENT_LOST_S + 1 if timeout is None else timeout):
      if timeout is not None: raise subprocess.TimeoutExpired(f"stage {self.index}", timeout)
      self.ended(-signal.SIGKILL)
    return self.returncode  # type: ignore[return-value]

  def _signal(self, signum: int) -> None:
    if self.returncode is None:
      try: self.agent.signal.remote(self.index, signum)
      except Exception: log.debug("signal to a lost host's stage %d", self.index, exc_info=True)  # noqa: BLE001

  def terminate(self) -> None: self._signal(signal.SIGTERM)
  def kill(self) -> None: self._signal(signal.SIGKILL)


class _RemoteStdin:
  def __init__(self, proc: RemoteProcess): self.proc = proc
  def write(self, line: str) -> None:
    if self.proc.returncode is not None: raise BrokenPipeError(f"stage {self.proc.index} exited")
    self.proc.agent.send.remote(self.proc.index, line)
  def flush(self) -> None: pass
  def close(self) -> None: pass


class RayPlacement:
  """The stages on `hosts` Ray nodes, one agent each (STRICT_SPREAD: no two on one node), joined by bridges. Made by
  the launcher's start() in place of a LocalPlacement; its `arena` holds the launcher's head and tail rings only."""

  def __init__(self, *, specs: Sequence[Any], n_stages: int, hosts: int | None, address: str | None, source: str | None,
               cache_dir: str | None, local_model: str, env: dict[str, str], devices: Sequence[str],
               on_event: Callable[[dict], None], check_open: Callable[[], None]):
    # long (~60 lines) because placing is one transaction: every step either completes or closes what the steps before made
    from pyruntime.transport.ring import Arena
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    self.ray, self._remove_pg = ray, remove_placement_group
    self.n_stages, self.on_event = n_stages, on_event
    self.agents: list[Any] = []
    self.pg: Any = None
    self.arena: Any = None
    self.handles: list[StageHandle] = []
    self.sender: BridgeSender | None = None
    self.receiver: BridgeReceiver | None = None
    self.host_rings: list[list[float]] = []
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self.lost: set[int] = set()  # hosts found gone: their agents are killed, not asked
    if not ray.is_initialized():
      ray.init(address=address or "auto", logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    n_hosts = min(n_stages, len(nodes)) if hosts is None else hosts
    self.ranges = host_ranges(n_stages, n_hosts)
    secret = secrets.token_bytes(32)
    try:
      self.pg = placement_group([self._bundle(devices[a:b]) for a, b in self.ranges], strategy="STRICT_SPREAD")
      if not self._wait_placed(ray, check_open):
        raise errors.PlacementUnavailable(f"the cluster could not place {n_hosts} hosts on {n_hosts} different nodes within "
                                          f"{PLACE_TIMEOUT_S:g} s ({len(nodes)} nodes alive)")
      agent_cls = ray.remote(HostAgent)
      for k, (a, b) in enumerate(self.ranges):
        opts = self._bundle(devices[a:b])
        self.agents.append(agent_cls.options(
          num_cpus=opts["CPU"], num_gpus=opts.get("GPU", 0), max_restarts=0,
          scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=k),
        ).remote(k, a, b - a, n_stages, secret, env))
      self.hosts = ray.get([ag.hello.remote(source, cache_dir) for ag in self.agents], timeout=PLACE_TIMEOUT_S)
      self._check_hosts(local_model)
      check_open()
      self.arena = Arena.create([specs[0], specs[-1]])
      hello = self.hosts[0]
      def link(ring: int) -> dict: return link_hello(hello["version"], ABI_VERSION, hello["model"], link_name(ring, n_stages))
      self.receiver = BridgeReceiver(self.arena.writer(1), secret, link(n_stages), bind=ray.util.get_node_ip_address(),
                                     on_end=self._tail_ended, name=link_name(n_stages, n_stages))
      opened = ray.get([ag.open.remote([(s.capacity, s.max_extent, s.alignment) for s in specs[a:b + 1]])
                        for ag, (a, b) in zip(self.agents, self.ranges, strict=True)], timeout=PLACE_TIMEOUT_S)
      self.opened = opened
      nexts = [o["address"] for o in opened[1:]] + [list(self.receiver.address)]
      ray.get([ag.connect.remote(addr) for ag, addr in zip(self.agents, nexts, strict=True)], timeout=PLACE_TIMEOUT_S)
      self.sender = BridgeSender(self.arena.reader(0), tuple(opened[0]["address"]), secret, link(0), on_end=self._head_ended,
                                 name=link_name(0, n_stages))
      for k, (ag, (a, _), o) in enumerate(zip(self.agents, self.ranges, opened, strict=True)):
        for j, pid in enumerate(o["pids"]):
          h = StageHandle(a + j, RemoteProcess(ag, a + j, pid), io.BytesIO())  # type: ignore[arg-type]
          h.host = self.where(k)
          self.handles.append(h)
        self.host_rings.append([])
        t = threading.Thread(target=self._watch, args=(k,), name=f"host-{k}-watch", daemon=True)
        t.start()
        self._threads.append(t)
    except BaseException:
      self.close()
      raise

  @staticmethod
  def _bundle(devices: Sequence[str]) -> dict[str, float]:
    """A host's resources: a CPU for its agent, and a GPU for every accelerator its stages use."""
    from pyruntime.devices import parse_device
    gpus = len({spec.name for spec in map(parse_device, devices) if spec.base not in ("CPU", "NULL")})
    return {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}

  def _wait_placed(self, ray: Any, check_open: Callable[[], None]) -> bool:
    deadline = time.monotonic() + PLACE_TIMEOUT_S
    ready = self.pg.ready()
    while time.monotonic() < deadline:
      check_open()
      done, _ = ray.wait([ready], timeout=0.5)
      if done: return True
    return False

  def _check_hosts(self, local_model: str) -> None:
    """Every host runs our package version and ring ABI, and resolved the model the launcher planned with."""
    ours = {"version": package_version(), "abi": ABI_VERSION, "model": local_model}
    for h in self.hosts:
      for key, want in ours.items():
        if h.get(key) != want:
          raise errors.HostMismatch(f"host {h['host']} (node {h['node'][:12]}, {h['ip']}) has {key} {h.get(key)!r}, the launcher "
                                    f"{want!r}" + (f" (its file: {h['model_path']})" if key == "model" else ""))

  def where(self, k: int) -> dict:
    """Host k in a stage's view: its index, Ray node, address, and the model file its stages load."""
    h = self.hosts[k]
    return {"index": k, "node": h["node"], "ip": h["ip"], "model_path": h["model_path"]}

  def host_of(self, stage: int) -> int:
    return next(k for k, (a, b) in enumerate(self.ranges) if a <= stage < b)

  # --- what the launcher asks -------------------------------------------------------------------------------------
  def spawn(self, index: int) -> StageHandle: return self.handles[index]

  def ring_args(self, h: StageHandle) -> dict:
    k = self.host_of(h.index)
    a = self.ranges[k][0]
    return {"arena": self.opened[k]["arena"], "ingress": h.index - a, "egress": h.index - a + 1}

  def model_path(self, h: StageHandle) -> str: return h.host["model_path"]  # type: ignore[index]

  @property
  def head_ring(self) -> int: return 0

  @property
  def tail_ring(self) -> int: return 1

  def ring_occupancy(self) -> list[float]:
    """Ring i's fill, i = 0 .. n_stages, from the launcher's two rings and each agent's latest poll; a ring that a
    bridge continues on the next host counts as full as its fuller copy."""
    occ = [0.0] * (self.n_stages + 1)
    for k, (a, _) in enumerate(self.ranges):
      for j, v in enumerate(self.host_rings[k]): occ[a + j] = max(occ[a + j], v)
    if self.arena is not None and not self.arena.closed:
      for i, ring in ((0, 0), (self.n_stages, 1)): occ[i] = max(occ[i], self.arena.occupancy(ring))
    return occ

  def bridge_stats(self) -> list[dict]:
    """Records and bytes each bridge carried: the launcher's two, then each host's in and out."""
    out = [{"link": link_name(0, self.n_stages), **(self.sender.stats() if self.sender else {})},
           {"link": link_name(self.n_stages, self.n_stages), **(self.receiver.stats() if self.receiver else {})}]
    for k, b in enumerate(self.ray.get([ag.bridges.remote() for ag in self.agents], timeout=AGENT_LOST_S)):
      out.append({"host": k, **b})
    return out

  # --- watching -----------------------------------------------------------------------------------------------------
  def _watch(self, k: int) -> None:
    """Host k's stages' events into their handles, as stage_pool's reader thread does for a local process."""
    ag, (a, b) = self.agents[k], self.ranges[k]
    by_index = {h.index: h for h in self.handles[a:b]}
    while not self._stop.is_set():
      try: out = self.ray.get(ag.poll.remote(), timeout=AGENT_LOST_S)
      except Exception as e:  # noqa: BLE001 - RayActorError, GetTimeoutError, a lost node: the host is gone
        if not self._stop.is_set(): self._host_lost(k, "HostLost", f"its agent is gone or silent ({type(e).__name__}: {str(e)[:200]})")
        return
      for ev in out["events"]:
        if "host" in ev:  # a bridge to or from another host was lost: that host is gone for this pipeline
          self._host_lost(ev["host"], ev["reason"], ev.get("message", ""), first=ev["stage"])
        elif (h := by_index.get(ev.get("stage"))) is not None: h.take_event(ev, self.on_event)
      for i, beat in out["beats"].items():
        h = by_index[int(i)]
        if beat != h.beat: h.note_beat(beat)
      for i, (rc, tail) in out["exits"].items():
        h = by_index[int(i)]
        h.stderr.write(tail.encode())
        self._ended(h, rc)
      self.host_rings[k] = out["rings"]
      if all(h.proc.poll() is not None for h in by_index.values()): return
      self._stop.wait(AGENT_POLL_S)

  def _ended(self, h: StageHandle, rc: int) -> None:
    if h.proc.poll() is None:
      h.proc.ended(rc)  # type: ignore[attr-defined]
      h.read_all.set()
      h.events.put(None)

  def _named(self, k: int) -> str:
    where = self.hosts[k]
    return f"host {k} (node {where['node'][:12]}, {where['ip']})"

  def _host_lost(self, k: int, reason: str, detail: str, first: int | None = None) -> None:
    """Host k is gone for this pipeline: each of its stages fails with `reason`, naming the host (`first`, the stage a
    lost bridge led to, is the one reported), and counts as ended, so stopping the pipeline does not wait on a host that
    may never answer; killing its agent takes its stages with it (their parent-death signal)."""
    self.lost.add(k)
    a, b = self.ranges[k]
    for i in ([first] if first is not None else []) + list(range(a, b)):
      h = self.handles[i]
      if h.fatal is None or h.fatal.get("reason") in AFTERMATH and reason not in AFTERMATH:
        h.fatal = {"event": Event.WORKER_FATAL, "stage": h.index, "reason": reason, "host": k, "message": f"{self._named(k)}: {detail}"}
      if a <= i < b: self._ended(h, -signal.SIGKILL)

  def _tail_ended(self, error: errors.PyruntimeError | None) -> None:
    if error is not None and self.handles:  # (the launcher's sender reads a ring only the launcher writes: no PeerDead)
      self._host_lost(len(self.ranges) - 1, error.code, f"the bridge to the launcher: {error}", first=self.n_stages - 1)

  def _head_ended(self, error: errors.PyruntimeError | None) -> None:
    if error is not None and self.handles: self._host_lost(0, error.code, f"the bridge from the launcher: {error}", first=0)

  def sweep(self) -> None:
    """A lost host's agent is killed without closing in order, and Ray may kill its stages before they unlink its arena:
    a task on that node unlinks what the dead agent created. A node that is really gone takes its /dev/shm with it."""
    if not self.lost: return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    sweep = self.ray.remote(num_cpus=0, max_retries=0)(sweep_segments)
    refs = [sweep.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=self.hosts[k]["node"], soft=False)).remote(self.hosts[k]["pid"])
            for k in sorted(self.lost)]
    self.ray.wait(refs, num_returns=len(refs), timeout=AGENT_LOST_S + 2)

  # --- stopping -------------------------------------------------------------------------------------------------------
  def close(self, grace_s: float = 5.0) -> None:
    """Every agent stops its stages and unlinks its arena, then is killed; the placement group goes; our bridges and
    arena close. Idempotent; a lost host's agent is only killed."""
    self._stop.set()
    for b in (self.sender, self.receiver):
      if b is not None: b.close()
    if self.agents:
      refs = [ag.close.remote(grace_s) for k, ag in enumerate(self.agents) if k not in self.lost]
      if refs: self.ray.wait(refs, num_returns=len(refs), timeout=grace_s + 3)  # all at once; the late ones are killed
      for ag in self.agents:
        try: self.ray.kill(ag, no_restart=True)
        except Exception: log.debug("killing an agent", exc_info=True)  # noqa: BLE001 - gone already
      self.agents = []
    if self.pg is not None:
      try: self._remove_pg(self.pg)
      except Exception: log.debug("removing the placement group", exc_info=True)  # noqa: BLE001
      self.pg = None
    for t in self._threads: t.join(AGENT_LOST_S + 1)
    if self.arena is not None: self.arena.close()
