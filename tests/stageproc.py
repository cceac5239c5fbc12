"""Drive one real `python -m pyruntime.stage` process over its JSON-lines control channel, through the launcher's
own StageHandle (pyruntime.launcher.spawn_stage): the tests talk to a stage exactly as the launcher does."""
from __future__ import annotations

import queue

from pyruntime.engine.stage_pool import spawn_stage


class StageProc:
  def __init__(self, env: dict | None = None) -> None:
    self.h = spawn_stage(0, env)
    self.p = self.h.proc
    self.seen: list[dict] = []
    self.ended = False   # the event reader saw the process's end

  def send(self, command: str, **args) -> None: self.h.send(command, **args)

  def send_raw(self, line: str) -> None:
    self.p.stdin.write(line + "\n")
    self.p.stdin.flush()

  def next_event(self, timeout: float = 120.0) -> dict | None:
    if self.ended: return None
    try: ev = self.h.events.get(timeout=timeout)
    except queue.Empty: raise TimeoutError(f"no event within {timeout} s; seen {self.seen}") from None
    if ev is None: self.ended = True
    else: self.seen.append(ev)
    return ev

  def expect(self, name: str, timeout: float = 120.0) -> dict:
    while (ev := self.next_event(timeout)) is not None:
      if ev["event"] == name: return ev
      if ev["event"] == "WorkerFatal": raise AssertionError(f"expected {name}, got {ev}")
    raise AssertionError(f"the stage exited before {name}; seen {self.seen}; stderr {self.h.stderr_tail()}")

  def fatal(self, timeout: float = 120.0) -> dict:
    """The WorkerFatal event, after which the process must exit on its own, non-zero."""
    while (ev := self.next_event(timeout)) is not None:
      if ev["event"] == "WorkerFatal":
        assert self.p.wait(timeout=10) != 0
        return ev
    raise AssertionError(f"the stage exited without WorkerFatal; seen {self.seen}")

  def setup(self, model: str, start: int, end: int, device: str = "CPU", **role) -> dict:
    self.send("InitializeWorker", device=device)
    self.expect("WorkerReady")
    self.send("ConfigureRole", stage=role.pop("stage", 0), start=start, end=end, **role)
    self.expect("RoleConfigured")
    self.send("LoadWeights", model=model)
    info = self.expect("WeightsLoaded")
    self.expect("WarmedUp")  # LoadWeights ends once the graphs a request needs are ready
    return info

  def close(self) -> None:
    if self.p.poll() is None:
      self.p.kill()
    self.p.wait()
    while not self.ended: self.next_event(30)   # the reader thread is done with stdout before it is closed
    for f in (self.p.stdin, self.p.stdout, self.h.stderr):
      try: f.close()
      except OSError: pass
