"""The agent on each host of a pipeline over several hosts (docs/hosts.md): a Ray actor that spawns its host's stages
with the machinery a single host uses (stage_pool.spawn_stage, an arena of rings), relays their control channels to
the launcher's polls, and bridges its first and last rings to the neighbouring hosts (pyruntime/transport/bridge.py).
Also what both sides of a bridge agree on: the package version, the model's identity, each link's name. The
placement that starts agents and watches them is hosts.py, in the launcher's process.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import time
from typing import Any, Sequence

from pyruntime import errors
from pyruntime.engine.stage_pool import StageHandle, spawn_stage
from pyruntime.protocol import ABI_VERSION, Event
from pyruntime.transport.bridge import BridgeReceiver, BridgeSender, link_hello

log = logging.getLogger("pyruntime.hosts")

AGENT_LOST_S = 3.0      # an agent that does not answer a poll this long has lost its host


def package_version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try: return version("pyruntime")
  except PackageNotFoundError: return "unknown"


def model_identity(path: str | os.PathLike) -> str:
  """Names a model file's bytes cheaply: its size and its first and last MiB (the GGUF header, its tensor table, and
  the end of the last tensor), so two hosts' copies are compared without reading gigabytes."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    h.update(str(size).encode())
    h.update(f.read(1 << 20))
    f.seek(max(0, size - (1 << 20)))
    h.update(f.read(1 << 20))
  return h.hexdigest()[:16]


def link_name(ring: int, n_stages: int) -> str:
  """Ring `ring` of the pipeline in words: what writes it and what reads it."""
  src = "the launcher" if ring == 0 else f"stage {ring - 1}"
  dst = "the launcher" if ring == n_stages else f"stage {ring}"
  return f"ring {ring} ({src} to {dst})"


class HostAgent:
  """One host's part of the pipeline (a Ray actor; plain Python, so it is also tested without Ray). Ray runs one
  method at a time, in the order they were sent: the launcher's control lines reach each stage in order."""

  def __init__(self, host: int, first: int, count: int, n_stages: int, secret: bytes, env: dict[str, str]):
    self.host, self.first, self.count, self.n_stages, self.secret = host, first, count, n_stages, secret
    self.env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    self.handles: list[StageHandle] = []
    self.arena: Any = None
    self.receiver: BridgeReceiver | None = None
    self.sender: BridgeSender | None = None
    self.hello_fields: dict[str, Any] = {}
    self.events: queue.SimpleQueue = queue.SimpleQueue()  # bridge failures, as WorkerFatal events of the stage they feed

  def hello(self, source: str | None, cache_dir: str | None) -> dict:
    """Who this host is and what it runs: node, address, pid, package version, ring ABI, the model file it resolved."""
    from pyruntime.modelfile.source import resolve_model
    path = resolve_model(source, cache_dir=cache_dir)
    try:
      import ray
      node, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except ImportError: node, ip = "local", "127.0.0.1"
    self.hello_fields = {"host": self.host, "node": node, "ip": ip, "pid": os.getpid(), "version": package_version(),
                         "abi": ABI_VERSION, "model_path": str(path), "model": model_identity(path)}
    return self.hello_fields

  def open(self, specs: Sequence[tuple[int, int, int]]) -> dict:
    """This host's arena (its stages' ingress rings and the last one's egress), its stage processes, and the receiving
    end of the bridge into its first ring. Returns the arena's name, the bridge's address and the stages' pids."""
    from pyruntime.transport.ring import Arena, RingSpec
    self.arena = Arena.create([RingSpec(*s) for s in specs])
    self.handles = [spawn_stage(self.first + j, self.env) for j in range(self.count)]
    ring = self.first
    # a bridge that is lost names its far end: the host (and stage) that went away, or the launcher's side
    up = (self.host - 1, self.first - 1) if self.host > 0 else (self.host, self.first)
    self.receiver = BridgeReceiver(self.arena.writer(0), self.secret, self._link(ring), bind=self.hello_fields.get("ip", "127.0.0.1"),
                                   on_end=lambda e: self._bridge_ended(e, *up, f"the bridge into host {self.host}"),
                                   name=link_name(ring, self.n_stages))
    return {"arena": self.arena.name, "address": list(self.receiver.address), "pids": [h.proc.pid for h in self.handles]}

  def connect(self, address: Sequence) -> None:
    """The sending end of the bridge out of this host's last ring, to the next host (or the launcher) at `address`."""
    ring = self.first + self.count
    down = (self.host + 1, ring) if ring < self.n_stages else (self.host, ring - 1)
    self.sender = BridgeSender(self.arena.reader(self.count), (str(address[0]), int(address[1])), self.secret, self._link(ring),
                               on_end=lambda e: self._bridge_ended(e, *down, f"the bridge out of host {self.host}"),
                               name=link_name(ring, self.n_stages))

  def _link(self, ring: int) -> dict:
    f = self.hello_fields
    return link_hello(f.get("version", package_version()), ABI_VERSION, f.get("model", ""), link_name(ring, self.n_stages))

  def _bridge_ended(self, error: errors.PyruntimeError | None, host: int, stage: int, what: str) -> None:
    if error is not None and not isinstance(error, errors.PeerDead):  # a local stage's death is its exit's to report
      self.events.put({"event": Event.WORKER_FATAL, "stage": stage, "host": host, "reason": error.code, "message": f"{what}: {error}"})

  def send(self, stage: int, line: str) -> None:
    """A control line for one of this host's stages, as the launcher wrote it."""
    h = self.handles[stage - self.first]
    try:
      h.proc.stdin.write(line)
      h.proc.stdin.flush()
    except (BrokenPipeError, ValueError, OSError): pass  # gone: its exit is reported by poll()

  def signal(self, stage: int, signum: int) -> None:
    p = self.handles[stage - self.first].proc
    if p.poll() is None: p.send_signal(signum)

  def poll(self) -> dict:
    """What happened since the last poll: each stage's events (None: it exited, with its exit code and stderr's tail),
    its latest Heartbeat, and the fill of this host's rings."""
    events: list[dict] = []
    while True:
      try: events.append(self.events.get_nowait())
      except queue.Empty: break
    exits: dict[int, tuple[int, str]] = {}
    for h in self.handles:
      while True:
        try: ev = h.events.get_nowait()
        except queue.Empty: break
        if ev is None: exits[h.index] = (h.proc.returncode, h.stderr_tail(2000))
        else: events.append(ev)
    beats = {h.index: h.beat for h in self.handles if h.beat is not None}
    rings = [] if self.arena is None or self.arena.closed else [self.arena.occupancy(i) for i in range(self.arena.ring_count)]
    return {"events": events, "beats": beats, "exits": exits, "rings": rings}

  def bridges(self) -> dict:
    return {"in": self.receiver.stats() if self.receiver else None, "out": self.sender.stats() if self.sender else None}

  def close(self, grace_s: float = 5.0) -> None:
    """Stop this host's part: the stages (already asked to shut down by the launcher) get `grace_s`, then SIGKILL;
    bridges closed; the arena unlinked. Idempotent."""
    from pyruntime.engine.stage_pool import stop_stages
    if self.arena is not None: self.arena.unlink()  # first: the launcher kills this actor if closing takes too long
    stop_stages(self.handles, grace_s, failed=True)
    for b in (self.sender, self.receiver):
      if b is not None: b.close()
    if self.arena is not None: self.arena.close()


def sweep_segments(agent_pid: int, wait_s: float = AGENT_LOST_S) -> list[str]:
  """On a lost host's node: once its agent is dead, unlink the segments it created (shm.cleanup_stale's rule)."""
  from pyruntime.transport.shm import DEFAULT_PREFIX, cleanup_stale, process_alive
  deadline = time.monotonic() + wait_s
  while process_alive(agent_pid) and time.monotonic() < deadline: time.sleep(0.05)
  return cleanup_stale(f"{DEFAULT_PREFIX}-{agent_pid}")
