"""The stage processes of a pipeline: spawning one (`python -m pyruntime.stage`), reading its control channel on a
thread of its own, and what the launcher watches (its Heartbeats, its fatal event, its exit); and `LocalPlacement`,
every stage on this host with every ring in one arena (pyruntime/engine/hosts.py has the placement over several hosts).
`StagePool` watches and stops them. The launcher's driver owns the streams; this module owns the processes.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pyruntime import errors
from pyruntime.options import STALL_STEPS
from pyruntime.protocol import Command, Event


@dataclass
class StageHandle:
  """One stage process and its control channel."""
  index: int
  proc: subprocess.Popen
  stderr: Any
  events: queue.Queue = field(default_factory=queue.Queue)
  fatal: dict | None = None
  info: dict = field(default_factory=dict)
  send_lock: threading.Lock = field(default_factory=threading.Lock)
  beat: dict | None = None      # its last Heartbeat, and when it came
  beat_t: float = 0.0
  progress_t: float = 0.0       # when it last made progress, or said it had nothing to do (the stall rule)
  working_t: float = 0.0        # when a Heartbeat last showed its CPU time advancing at a working rate (the stall rule)
  read_all: threading.Event = field(default_factory=threading.Event)  # its output is read to the end (it exited)
  host: dict | None = None      # where it runs, when not on this host (pyruntime/engine/hosts.py: index, node, ip, model_path)

  @property
  def alive(self) -> bool: return self.proc.poll() is None and self.fatal is None

  def note_beat(self, ev: dict) -> None:
    now, last = time.monotonic(), self.beat
    if last is None or not ev.get("busy") or (ev.get("steps"), ev.get("records")) != (last.get("steps"), last.get("records")):
      self.progress_t = now
    if last is not None and _cpu_share(last, ev) >= WORKING_CPU_SHARE: self.working_t = now
    self.beat, self.beat_t = ev, now

  def state(self) -> str:
    """Its process's state as the kernel tells it ('stopped' for SIGSTOP), where it runs on this host; else ''."""
    if self.host is not None: return ""
    try:
      with open(f"/proc/{self.proc.pid}/stat", "rb") as f: letter = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError): return ""
    return PROCESS_STATES.get(letter, letter)

  def take_event(self, ev: dict, on_event: Callable[[dict], None] | None) -> None:
    """One event from the stage's control channel (read here, or relayed by its host's agent, pyruntime/engine/hosts.py)."""
    if ev.get("event") == Event.HEARTBEAT:  # twice a second for the stage's life: kept as state, not as events
      self.note_beat(ev)
      return
    if ev.get("event") == Event.WORKER_FATAL: self.fatal = ev
    if on_event is not None: on_event(ev)
    self.events.put(ev)

  def send(self, command: str, **args: Any) -> None:
    line = json.dumps({"command": command, **args}) + "\n"
    try:
      with self.send_lock:  # lines from several threads (a stream's grammar, stats) must not interleave
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
    except (BrokenPipeError, ValueError, OSError):
      pass  # the process is gone; its reader thread reports why

  def stderr_tail(self, n: int = 2000) -> str:
    try:
      self.stderr.flush(); self.stderr.seek(0, os.SEEK_END)
      self.stderr.seek(max(0, self.stderr.tell() - n))
      return self.stderr.read().decode(errors="replace")
    except (OSError, ValueError): return ""

  def failure(self) -> errors.StageFailed | None:
    if self.fatal is not None:
      reason, message = self.fatal.get("reason", Event.WORKER_FATAL), self.fatal.get("message", "")
      if "host" in self.fatal: return errors.HostLost(self.fatal["host"], self.index, reason, message)
      return errors.StageFailed(self.index, reason, self._where() + message)
    if (rc := self.proc.poll()) is not None:
      how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
      return errors.StageFailed(self.index, "WorkerExited", f"{self._where()}{how}; stderr tail: {self.stderr_tail(600).strip()}")
    return None

  def _where(self) -> str:
    return f"on host {self.host['index']} (node {self.host['node'][:12]}, {self.host['ip']}): " if self.host else ""


def spawn_stage(index: int, env: dict[str, str] | None = None, on_event: Callable[[dict], None] | None = None) -> StageHandle:
  """Start one `python -m pyruntime.stage` process, and the thread that puts its events on `h.events` (None at its
  end), calling `on_event` with each first. The launcher's way, and the tests' (tests/stageproc.py)."""
  err = tempfile.TemporaryFile()
  proc = subprocess.Popen([sys.executable, "-m", "pyruntime.stage"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=err, env=env, text=True, bufsize=1)
  h = StageHandle(index, proc, err)
  threading.Thread(target=_pump, args=(h, on_event), name=f"stage-{index}-events", daemon=True).start()
  return h


def _pump(h: StageHandle, on_event: Callable[[dict], None] | None) -> None:
  for line in h.proc.stdout:
    try: ev = json.loads(line)
    except json.JSONDecodeError: continue
    ev.setdefault("stage", h.index)
    h.take_event(ev, on_event)
  h.proc.wait()
  h.read_all.set()
  h.events.put(None)  # EOF: the process is gone


PROCESS_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped by a tracer",
                  "Z": "exited"}  # /proc/PID/stat's state letter, in words


def _cpu_share(a: dict, b: dict) -> float:
  """The share of one core a stage's process used between two of its Heartbeats (by its own clock), 0 if unknown."""
  try: dt, dc = float(b["clock_s"]) - float(a["clock_s"]), float(b["cpu_s"]) - float(a["cpu_s"])
  except (KeyError, TypeError, ValueError): return 0.0
  return dc / dt if dt > 0 else 0.0


# --- watching and stopping a pipeline's stages ----------------------------------------------------------------------
AFTERMATH = {"PeerDead": 2, "RingClosed": 2, "BridgeLost": 1}  # what a failure elsewhere causes: reported after a root cause
WAIT_POLL_S = 0.05  # how often a waiting launcher looks at its stages' health
WORKING_CPU_SHARE = 0.25  # a stage whose process used this share of a core between two Heartbeats is computing, not hung
SETTLE_S = 0.5  # how long a closed tail ring waits for the failure behind it to be reported


def stop_stages(handles: list[StageHandle], grace_s: float, failed: bool) -> None:
  """Ask every stage to shut down (after a failure: SIGTERM), give them `grace_s`, then SIGKILL; close our pipes."""
  for h in handles:
    if not failed: h.send(Command.SHUTDOWN_WORKER)
    elif h.proc.poll() is None: h.proc.terminate()
  deadline = time.monotonic() + grace_s
  for h in handles:
    try: h.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      h.proc.kill()
      h.proc.wait()
  for h in handles:
    for f in (h.proc.stdin, h.stderr):
      try: f.close()
      except OSError: pass


class StagePool:
  """The stage processes of one pipeline, wherever `placement` runs them: spawned one at a time, watched (their
  events, the stall rule, failures) and stopped. The launcher asks; the driver asks while streams run."""

  def __init__(self, placement: Any, on_event: Callable[[dict], None], check_open: Callable[[], None], stall_timeout: float,
               stall_capture_timeout: float):
    self.placement, self.on_event, self.check_open = placement, on_event, check_open
    self.stall_timeout, self.stall_capture_timeout = float(stall_timeout), float(stall_capture_timeout)
    self.handles: list[StageHandle] = []

  def spawn(self, index: int) -> StageHandle:
    h = self.placement.spawn(index)
    self.handles.append(h)
    self.on_event({"event": "StageSpawned", "stage": index, "pid": h.proc.pid})
    return h

  def expect(self, h: StageHandle, name: str, timeout: float, bound: float | None = None) -> dict:
    """Stage h's next event called `name` within `timeout` s (what is left of a `bound` shared by several waits, which
    the timeout's message names); the failure (of h or any stage) that comes first raises as StageFailed."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
      self.check_open()
      try: ev = h.events.get(timeout=min(WAIT_POLL_S * 4, max(0.0, deadline - time.monotonic())))
      except queue.Empty: ev = {}
      if ev is None or (ev and ev.get("event") == Event.WORKER_FATAL): raise h.failure() or errors.StageFailed(h.index, "WorkerExited")
      if ev and ev.get("event") == name: return ev
      if (f := self.first_failure()) is not None: raise f
      if time.monotonic() > deadline: raise errors.StageFailed(h.index, "Timeout", f"no {name} within {bound or timeout:.0f} s")

  def first_failure(self) -> errors.StageFailed | None:
    """The failure to report: a dead stage makes its neighbours fail too (PeerDead, RingClosed), so the root cause first."""
    failures = [f for h in self.handles if (f := h.failure()) is not None]
    return min(failures, key=lambda f: AFTERMATH.get(f.reason, 0), default=None)

  def root_cause(self) -> errors.StageFailed | None:
    """The tail ring closed under the driver: the failure that closed it, given up to SETTLE_S to be reported (a
    stage's fatal event, or a remote host's, can come after the close that it caused has run down the rings)."""
    deadline = time.monotonic() + SETTLE_S
    while (f := self.first_failure()) is None or f.reason in AFTERMATH:
      if time.monotonic() > deadline: return f
      time.sleep(WAIT_POLL_S / 5)
    return f

  def stall_bound(self, h: StageHandle) -> float:
    """How long stage h may have work and make no progress: `stall_timeout`, or STALL_STEPS of its slowest step if that
    is longer; `stall_capture_timeout` while it captures a graph (it says so before, and beats again after) or while
    its CPU time advances (a step that computes: a first launch compiling, a long chunk on a big model)."""
    b = h.beat or {}
    if b.get("capturing") or self.working(h): return self.stall_capture_timeout
    return max(self.stall_timeout, STALL_STEPS * float(b.get("slowest_s") or 0.0))

  def working(self, h: StageHandle) -> bool:
    """Whether h's CPU time advanced at a working rate within the last `stall_timeout` (its Heartbeats say)."""
    return time.monotonic() - h.working_t <= self.stall_timeout

  def stalled(self) -> errors.StageStalled | None:
    """The stall rule (docs/control-channel.md, "Stalls"): the first stage whose last progress (a step finished or a
    record taken, counted by its data loop's own thread and reported in Heartbeats; or a Heartbeat saying it had nothing
    to do) is older than its bound: `stall_timeout` for a stage whose CPU time stands still (hung, stopped), the larger
    `stall_capture_timeout` for one that computes. The caller asks only while the pipeline has work."""
    now = time.monotonic()
    for h in self.handles:
      quiet = now - h.progress_t
      if quiet > (b := self.stall_bound(h)):
        return errors.StageStalled(h.index, f"no progress for {quiet:.1f} s (bound {b:.1f} s) while the pipeline had work; {self._why(h, now)}")
    return None

  def _why(self, h: StageHandle, now: float) -> str:
    """Which kind of stall, and what the stage last said it was doing."""
    if self.working(h): kind = "it was computing all along (its CPU time advancing), longer than a step may take"
    elif h.working_t: kind = f"its CPU time stood still for {now - h.working_t:.1f} s"
    else: kind = "its CPU time never advanced while it had work"
    if state := h.state(): kind += f"; its process is {state}"
    if not h.beat: return f"{kind}; never heard from since it started"
    step = f" (a step running for {h.beat['step_s']:.1f} s)" if h.beat.get("step_s") is not None else ""
    return f"{kind}; last heard {now - h.beat_t:.1f} s ago: {h.beat.get('doing')}{step}"

  def view(self, split: list, devices: list) -> list[dict]:
    """What each stage is and last said of itself, without a round trip: layers, device, memory, alive, and its last
    Heartbeat (steps, tokens and busy seconds since its start, `t` when it came; `beat_age_s` since)."""
    now, out = time.monotonic(), []
    for i, h in enumerate(self.handles):
      beat = {k: v for k, v in (h.beat or {}).items() if k != "event"} | ({"t": h.beat_t} if h.beat is not None else {})
      age = round(now - h.beat_t, 3) if h.beat is not None else None
      out.append({"stage": i, "pid": h.proc.pid, "alive": h.alive, "layers": list(split[i]) if i < len(split) else None,
                  "device": devices[i] if i < len(devices) else None, "resident_bytes": h.info.get("resident_bytes"),
                  "family": h.info.get("family"), "host": h.host, "beat": beat, "beat_age_s": age})
    return out

  def profile_reports(self, events: list[dict], wait_s: float = 0.0) -> list[dict]:
    """Each stage's latest ProfileReport among `events`; `wait_s` lets stages that are exiting finish their output first."""
    deadline = time.monotonic() + wait_s
    for h in self.handles: h.read_all.wait(max(0.0, deadline - time.monotonic()))
    latest: dict[int, dict] = {}
    for ev in list(events):
      if ev.get("event") == Event.PROFILE_REPORT: latest[ev.get("stage", -1)] = ev
    return [latest[k] for k in sorted(latest)]

  def stop(self, grace_s: float, failed: bool) -> None:
    stop_stages(self.handles, grace_s, failed)
    self.placement.close(grace_s)

  def kill(self) -> None:
    """End at once whatever is left (a stage spawned after the pool was stopped), and the placement's segments."""
    for h in self.handles:
      if h.proc.poll() is None:
        h.proc.kill()
        h.proc.wait()
    self.placement.close(0.0)


class LocalPlacement:
  """Every stage a process of this host, every ring in one arena of ours: ring i feeds stage i, the last carries the
  tail's tokens back. The placement the launcher makes unless asked for Ray (hosts.RayPlacement, the same methods)."""

  def __init__(self, specs: list, env: dict[str, str], on_event: Callable[[dict], None]):
    from pyruntime.transport.ring import Arena
    self.arena = Arena.create(specs)
    self.env, self.on_event = env, on_event
    self.head_ring, self.tail_ring = 0, len(specs) - 1

  def spawn(self, index: int) -> StageHandle: return spawn_stage(index, self.env, self.on_event)

  def ring_args(self, h: StageHandle) -> dict: return {"arena": self.arena.name, "ingress": h.index, "egress": h.index + 1}

  def model_path(self, h: StageHandle) -> str | None: return None  # the launcher's own

  def ring_occupancy(self) -> list[float]:
    return [] if self.arena.closed else [self.arena.occupancy(i) for i in range(self.arena.ring_count)]

  def close(self, grace_s: float = 0.0) -> None: self.arena.close()

  def sweep(self) -> None: pass  # every segment is ours, unlinked by close()
